# Exact distributed evaluation, ranks as threads at world sizes 1, 2, 3.
ddp_add_test(NAME test_data_eval SOURCES test_data_eval.cpp LABEL collective LIBS ddp
             TIMEOUT 180)
