add_executable(bench_ddp bench_ddp.cpp)
target_link_libraries(bench_ddp PRIVATE ddp::ddp)
ddp_tool_target(bench_ddp)

# A program written as the README teaches, timed (compare.py --ours user-program).
add_executable(user_program user_program.cpp)
target_link_libraries(user_program PRIVATE ddp::ddp ddp_tools_common)
ddp_tool_target(user_program)
