# SyncBatchNorm: equivalence with one-process BatchNorm, converter, DDP with SyncBatchNorm.
ddp_add_test(NAME test_sync_batch_norm SOURCES test_sync_batch_norm.cpp LABEL collective
             LIBS ddp TIMEOUT 300)
