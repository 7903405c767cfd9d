# Checkpointer as a collective: rank 0 writes, all ranks agree on resume and on failures.
ddp_add_test(NAME test_checkpoint_collective SOURCES test_checkpoint_collective.cpp
             LABEL collective LIBS ddp TIMEOUT 300 FAULT_TIMEOUT 120
             FAULT "CheckpointCollective.RankZeroWriteFailure*:CheckpointCollective.OneRankFailingToLoad*")
