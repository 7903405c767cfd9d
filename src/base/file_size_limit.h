// Writing under a file-size limit (`ulimit -f`, RLIMIT_FSIZE) without dying of it.
//
// Note [File-size limit]
// Past RLIMIT_FSIZE, write(), fallocate() and ftruncate() raise SIGXFSZ, whose default action
// kills the process without a word (leaving, say, a checkpoint's temporary file behind). Memory
// files count too: a memfd for shared memory is a file. While a FileSizeSignalBlocked lives,
// SIGXFSZ is blocked in the calling thread, so such calls fail with EFBIG instead (POSIX) and
// the caller reports it like any other error. The signal the kernel still raises stays pending
// on this thread; it is taken (sigtimedwait, no wait) before the mask is restored, so it cannot
// kill the process later.
#pragma once

#include <signal.h>  // sigset_t

#include <cstdint>
#include <string>

namespace ddp::base {

class FileSizeSignalBlocked {
 public:
  FileSizeSignalBlocked();
  ~FileSizeSignalBlocked();
  FileSizeSignalBlocked(const FileSizeSignalBlocked&) = delete;
  FileSizeSignalBlocked& operator=(const FileSizeSignalBlocked&) = delete;

 private:
  sigset_t xfsz_{};
  sigset_t previous_{};
};

// Why a write of a `bytes`-byte file failed with EFBIG: "this process may write files of at
// most 1048576 bytes (ulimit -f 1024) and this one needs 4194816; raise the limit (ulimit -f
// unlimited)", or, without a limit, that the file system refused that size.
std::string file_too_large_reason(std::uint64_t bytes);

}  // namespace ddp::base
