ddp_add_test(NAME test_bucketing SOURCES test_bucketing.cpp LABEL unit LIBS ddp TIMEOUT 60)
ddp_add_test(NAME test_fsdp_buffers SOURCES test_fsdp_buffers.cpp LABEL unit LIBS ddp TIMEOUT 60)
