ddp_add_test(NAME test_train_parts SOURCES test_train_parts.cpp LABEL unit
             LIBS ddp_train_lib TIMEOUT 60)
