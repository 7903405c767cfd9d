# Data: sampler (cross-checked against Python's DistributedSampler), datasets, loader.
ddp_add_test(NAME test_sampler SOURCES test_sampler.cpp LABEL unit LIBS ddp TIMEOUT 60)
# zlib writes the damaged .gz copies the reader must reject.
find_package(ZLIB REQUIRED)
ddp_add_test(NAME test_data_datasets SOURCES test_data_datasets.cpp LABEL unit
             LIBS ddp ZLIB::ZLIB TIMEOUT 60)
ddp_add_test(NAME test_data_loader SOURCES test_data_loader.cpp LABEL unit LIBS ddp TIMEOUT 60)
