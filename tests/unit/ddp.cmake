ddp_add_test(NAME test_bucketing SOURCES test_bucketing.cpp LABEL unit LIBS ddp TIMEOUT 60)
