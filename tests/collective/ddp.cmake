ddp_add_test(NAME test_ddp_equivalence SOURCES test_ddp_equivalence.cpp LABEL collective
             LIBS ddp TIMEOUT 600)
ddp_add_test(NAME test_ddp_behaviour SOURCES test_ddp_behaviour.cpp LABEL collective
             LIBS ddp TIMEOUT 300)
ddp_add_test(NAME test_join SOURCES test_join.cpp LABEL collective LIBS ddp TIMEOUT 300
             FAULT "JoinTest.ThrowOnEarly*:JoinTest.WithoutJoin*" FAULT_TIMEOUT 120)

# DDP equivalence, behaviour and Join again, over the shared-memory transport.
foreach(t test_ddp_equivalence test_ddp_behaviour test_join)
  add_test(NAME ${t}_shm COMMAND ${t})
  set_tests_properties(${t}_shm PROPERTIES LABELS collective TIMEOUT 600
    ENVIRONMENT "DDP_BUILD_DIR=${PROJECT_BINARY_DIR};DDP_TEST_BACKEND=shm")
endforeach()

# DDP equivalence over the hierarchy (4 ranks as 2 hosts x 2: shm inside, Gloo between).
add_test(NAME test_ddp_equivalence_hier COMMAND test_ddp_equivalence)
set_tests_properties(test_ddp_equivalence_hier PROPERTIES LABELS collective TIMEOUT 600
  ENVIRONMENT "DDP_BUILD_DIR=${PROJECT_BINARY_DIR};DDP_TEST_BACKEND=shm+gloo;DDP_TEST_HOSTS=2")

# ZeroRedundancyOptimizer: sharded optimizer state, equal to the unsharded optimizer.
ddp_add_test(NAME test_zero SOURCES test_zero.cpp LABEL collective LIBS ddp TIMEOUT 300)

# FullyShardedDataParallel (ZeRO-2 and ZeRO-3, mixed precision, checkpoints): equal to one
# process at world 1-4, over the test backend (Gloo), over shm, and over the hierarchy (4 ranks
# as 2 hosts x 2: shm inside, Gloo between; 2 and 3 ranks one per host).
ddp_add_test(NAME test_fsdp SOURCES test_fsdp.cpp LABEL collective LIBS ddp TIMEOUT 300)
add_test(NAME test_fsdp_shm COMMAND test_fsdp)
set_tests_properties(test_fsdp_shm PROPERTIES LABELS collective TIMEOUT 300
  ENVIRONMENT "DDP_BUILD_DIR=${PROJECT_BINARY_DIR};DDP_TEST_BACKEND=shm")
add_test(NAME test_fsdp_hier COMMAND test_fsdp)
set_tests_properties(test_fsdp_hier PROPERTIES LABELS collective TIMEOUT 300
  ENVIRONMENT "DDP_BUILD_DIR=${PROJECT_BINARY_DIR};DDP_TEST_BACKEND=shm+gloo;DDP_TEST_HOSTS=2")

# The PowerSGD hook: equal to python3-torch's powerSGD_hook on the same gradients; resume.
ddp_add_test(NAME test_powersgd SOURCES test_powersgd.cpp LABEL collective LIBS ddp TIMEOUT 300)
target_compile_definitions(test_powersgd PRIVATE
  DDP_POWERSGD_REFERENCE="${CMAKE_CURRENT_SOURCE_DIR}/powersgd_reference.py")
# Over shm too; version-neutral: the hook's LibTorch side is checked against python3-torch on
# both versions by test_powersgd, the shm transport under DDP by test_ddp_equivalence_shm.
add_test(NAME test_powersgd_shm COMMAND test_powersgd)
set_tests_properties(test_powersgd_shm PROPERTIES LABELS "collective;version-neutral" TIMEOUT 300
  ENVIRONMENT "DDP_BUILD_DIR=${PROJECT_BINARY_DIR};DDP_TEST_BACKEND=shm")
