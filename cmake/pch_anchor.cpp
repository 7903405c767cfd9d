// The source of the programs that only build a precompiled LibTorch header, ddp_tools_pch and
// ddp_test_pch (Note [Precompiled LibTorch] in cmake/DdpHelpers.cmake); they run nothing.
int main() { return 0; }
