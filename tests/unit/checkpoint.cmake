# Checkpoints: file format and damage, contents and exact resume, the checkpoint directory.
# A file of format 1 (ddp-cpp 0.1.0) must still load: tests/data/format1 (its maker beside it).
ddp_add_test(NAME test_checkpoint_format SOURCES test_checkpoint_format.cpp LABEL unit
             LIBS ddp TIMEOUT 120 FAULT "DamagedCheckpoint.*" FAULT_TIMEOUT 60
             ENV DDP_FORMAT1_CHECKPOINT=${PROJECT_SOURCE_DIR}/tests/data/format1/format1.ckpt)
ddp_add_test(NAME test_checkpoint_resume SOURCES test_checkpoint_resume.cpp LABEL unit
             LIBS ddp TIMEOUT 120)
ddp_add_test(NAME test_checkpoint_dir SOURCES test_checkpoint_dir.cpp LABEL unit
             LIBS ddp TIMEOUT 120 FAULT_TIMEOUT 60
             FAULT "Checkpointer.AFailedWrite*:Checkpointer.ARealRename*:Checkpointer.TempFiles*")
# The run folder's lease: who may write into a run folder (Note [Run folder lease]).
ddp_add_test(NAME test_run_lease SOURCES test_run_lease.cpp LABEL unit LIBS ddp TIMEOUT 60)
