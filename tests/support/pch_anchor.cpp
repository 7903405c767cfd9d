// The program that builds the suite's precompiled LibTorch header (Note [One precompiled LibTorch]
// in tests/CMakeLists.txt); it runs nothing.
int main() { return 0; }
