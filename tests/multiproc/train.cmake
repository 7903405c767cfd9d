ddp_add_test(NAME test_ddp_train SOURCES test_ddp_train.cpp LABEL multiproc LIBS ddp
             TIMEOUT 900
             ENV DDPRUN=$<TARGET_FILE:ddprun> DDP_TRAIN=$<TARGET_FILE:ddp-train>
                 EVAL_SCRIPT=${CMAKE_CURRENT_SOURCE_DIR}/eval_fashion_mnist.py)
add_dependencies(test_ddp_train ddprun ddp-train)
# ddp-train under faults: preemption (SIGTERM), a second SIGTERM, the grace period's end, a
# killed worker restarted by ddprun --max-restarts. Version-neutral: the signals, the grace
# period and the restarts are ddprun's and ddp-train's; a kill and a bitwise resume through
# LibTorch's serialization run on both versions (test_readme_program, test_checkpoint_resume).
ddp_add_test(NAME test_ddp_train_faults SOURCES test_ddp_train_faults.cpp LABEL multiproc fault
             LIBS ddp TIMEOUT 600 VERSION_NEUTRAL
             ENV DDPRUN=$<TARGET_FILE:ddprun> DDP_TRAIN=$<TARGET_FILE:ddp-train>)
if(TARGET test_ddp_train_faults)
  add_dependencies(test_ddp_train_faults ddprun ddp-train)
endif()
