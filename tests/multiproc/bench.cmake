# ddp-bench end to end: alone and as 2 processes under ddprun, tiny sizes and few steps.
ddp_add_test(NAME test_ddp_bench SOURCES test_ddp_bench.cpp LABEL multiproc TIMEOUT 600
             ENV DDPRUN=$<TARGET_FILE:ddprun> DDP_BENCH=$<TARGET_FILE:ddp-bench>)
add_dependencies(test_ddp_bench ddprun ddp-bench)
