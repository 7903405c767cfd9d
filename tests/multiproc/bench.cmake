# ddp-bench end to end: alone and as 2 processes under ddprun, tiny sizes and few steps.
# Version-neutral: the tool's options, its report and its comparison runs; the models and DDP it
# times are checked on both versions (test_ddp_equivalence, test_ddp_train, test_bench_parts).
ddp_add_test(NAME test_ddp_bench SOURCES test_ddp_bench.cpp LABEL multiproc TIMEOUT 600
             VERSION_NEUTRAL
             ENV DDPRUN=$<TARGET_FILE:ddprun> DDP_BENCH=$<TARGET_FILE:ddp-bench>)
if(TARGET test_ddp_bench)
  add_dependencies(test_ddp_bench ddprun ddp-bench)
endif()
