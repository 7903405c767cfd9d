add_executable(bench_ddp bench_ddp.cpp)
target_link_libraries(bench_ddp PRIVATE ddp::ddp)
