// Shared segments: memfd + mmap (see Note [Shared segments] in segment.h).
#include "process_group/shm/segment.h"

#include <fcntl.h>     // open, fallocate
#include <sys/mman.h>  // memfd_create, mmap, munmap
#include <unistd.h>    // close

#include <cerrno>
#include <cstring>  // strerror
#include <utility>

#include <fmt/format.h>

#include "base/file_size_limit.h"  // FileSizeSignalBlocked
#include "ddp/error.h"

namespace ddp::shm {
namespace {

std::string errno_text() { return fmt::format("{} (errno {})", std::strerror(errno), errno); }

// MAP_POPULATE fills the page tables now: a collective that reads a peer's buffer for the first
// time would otherwise take a minor fault per 4 KiB page (0.5 ms per MiB on a VM), on every
// rank, in the middle of a backward pass.
char* map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

}  // namespace

Segment::~Segment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

Segment::Segment(Segment&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)),
      fd_(std::exchange(o.fd_, -1)) {}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    Segment old(std::move(*this));
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

Segment Segment::create(const std::string& name, size_t bytes) {
  Segment s;
  s.fd_ = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (s.fd_ < 0) throw Error(fmt::format("memfd_create failed: {}", errno_text()));
  // fallocate reserves every page now: a full memory limit fails here, not later as SIGBUS.
  // A memfd is a file: `ulimit -f` applies (EFBIG, not SIGXFSZ: Note [File-size limit]).
  const base::FileSizeSignalBlocked no_sigxfsz;
  if (int rc = posix_fallocate(s.fd_, 0, static_cast<off_t>(bytes)); rc != 0) {
    throw Error(fmt::format("cannot reserve {:.1f} MiB of shared memory: {} (errno {}){}",
                            bytes / 1048576.0, std::strerror(rc), rc,
                            rc == EFBIG ? fmt::format("; shared memory is a file here, and {}",
                                                      base::file_too_large_reason(bytes))
                                        : ""));
  }
  s.data_ = map(s.fd_, bytes);
  if (s.data_ == nullptr)
    throw Error(fmt::format("mmap of {} bytes failed: {}", bytes, errno_text()));
  s.size_ = bytes;
  return s;
}

Segment Segment::open(int pid, int fd, size_t bytes) {
  Segment s;
  const std::string path = fmt::format("/proc/{}/fd/{}", pid, fd);
  s.fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (s.fd_ < 0) throw Error(fmt::format("cannot open {}: {}", path, errno_text()));
  s.data_ = map(s.fd_, bytes);
  if (s.data_ == nullptr) throw Error(fmt::format("mmap of {} failed: {}", path, errno_text()));
  s.size_ = bytes;
  return s;
}

void Segment::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace ddp::shm
