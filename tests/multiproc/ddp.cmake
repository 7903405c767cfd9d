# DDP equivalence across real processes (the worker is also the one-process reference).
add_executable(ddp_equivalence_worker ddp_equivalence_worker.cpp)
target_link_libraries(ddp_equivalence_worker PRIVATE ddp::ddp)
ddp_test_program(ddp_equivalence_worker)
ddp_add_test(NAME test_ddp_processes SOURCES test_ddp_processes.cpp LABEL multiproc LIBS ddp
             TIMEOUT 600
             ENV DDPRUN=$<TARGET_FILE:ddprun>
                 EQUIVALENCE_WORKER=$<TARGET_FILE:ddp_equivalence_worker>)
add_dependencies(test_ddp_processes ddprun ddp_equivalence_worker)
