# Checkpoints: file format and damage, contents and exact resume, the checkpoint directory.
ddp_add_test(NAME test_checkpoint_format SOURCES test_checkpoint_format.cpp LABEL unit
             LIBS ddp TIMEOUT 120 FAULT "DamagedCheckpoint.*" FAULT_TIMEOUT 60)
ddp_add_test(NAME test_checkpoint_resume SOURCES test_checkpoint_resume.cpp LABEL unit
             LIBS ddp TIMEOUT 120)
ddp_add_test(NAME test_checkpoint_dir SOURCES test_checkpoint_dir.cpp LABEL unit
             LIBS ddp TIMEOUT 120 FAULT_TIMEOUT 60
             FAULT "Checkpointer.AFailedWrite*:Checkpointer.ARealRename*:Checkpointer.TempFiles*")
