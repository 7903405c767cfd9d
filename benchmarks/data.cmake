# Loader throughput vs a training step: is the input pipeline ever the bottleneck?
add_executable(bench_loader bench_loader.cpp)
target_link_libraries(bench_loader PRIVATE ddp::ddp)
ddp_tool_target(bench_loader)
