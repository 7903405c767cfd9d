ddp_add_test(NAME test_ddp_equivalence SOURCES test_ddp_equivalence.cpp LABEL collective
             LIBS ddp TIMEOUT 600)
ddp_add_test(NAME test_ddp_behaviour SOURCES test_ddp_behaviour.cpp LABEL collective
             LIBS ddp TIMEOUT 300)
ddp_add_test(NAME test_join SOURCES test_join.cpp LABEL collective LIBS ddp TIMEOUT 300)
