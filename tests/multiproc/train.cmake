ddp_add_test(NAME test_ddp_train SOURCES test_ddp_train.cpp LABEL multiproc LIBS ddp
             TIMEOUT 900
             ENV DDPRUN=$<TARGET_FILE:ddprun> DDP_TRAIN=$<TARGET_FILE:ddp-train>
                 EVAL_SCRIPT=${CMAKE_CURRENT_SOURCE_DIR}/eval_fashion_mnist.py)
add_dependencies(test_ddp_train ddprun ddp-train)
