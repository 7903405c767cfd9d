// Keeping freed memory for the next training step.
//
// glibc returns large freed blocks to the kernel: blocks above M_MMAP_THRESHOLD are separate
// mmaps, unmapped on free, and the heap's top is trimmed above M_TRIM_THRESHOLD. A training
// step frees its activations and allocates the same sizes again at the next step, so every step
// pays page faults for memory it just gave back. On this project's 2-core VM that was most of
// the step: the classic CNN at 2 ranks spent ~60% of its time in the kernel (46 000 minor faults
// per second per rank) and ran 2.5x faster with the memory kept (docs/performance.md).
//
//   int main(int argc, char** argv) {
//     ddp::retain_freed_memory();   // first thing, before large allocations
//
// Sets M_MMAP_THRESHOLD to glibc's largest (32 MiB on 64-bit: larger blocks are still mapped
// apart) and M_TRIM_THRESHOLD to 2 GiB, so a process keeps up to its peak heap. A user's own
// MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (or GLIBC_TUNABLES) win: then nothing is
// changed. Returns whether the settings were applied. Process-wide; call it from main(), not
// from library code. ddp-train and ddp-bench call it.
#pragma once

namespace ddp {

bool retain_freed_memory();

}  // namespace ddp
