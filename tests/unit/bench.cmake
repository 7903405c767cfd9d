# ddp-bench's pure parts: sizes, bus factors, the verification pattern, the command line.
ddp_add_test(NAME test_bench_parts SOURCES test_bench_parts.cpp LABEL unit
             LIBS ddp_bench_lib TIMEOUT 60)
