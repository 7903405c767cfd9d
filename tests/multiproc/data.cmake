# Sampler defaults and exact evaluation in real processes under ddprun (the test binary is
# also its own worker).
ddp_add_test(NAME test_data_multiproc SOURCES test_data_multiproc.cpp LABEL multiproc
             LIBS ddp TIMEOUT 180 ENV DDPRUN=$<TARGET_FILE:ddprun>)
add_dependencies(test_data_multiproc ddprun)
