// A block of memory shared by the ranks of one host.
//
// Note [Shared segments]
// A segment is an anonymous memfd (memfd_create). It has no name in /dev/shm or anywhere else,
// so a crash at any moment leaves nothing behind, and two jobs on one host can never open each
// other's segment through a colliding name (sglang#37179). The creating rank keeps the fd open
// until every peer has mapped the pages; a peer maps them by opening /proc/<creator pid>/fd/<fd>,
// which the kernel allows to processes of the same user in the same pid namespace (ranks that
// cannot, e.g. in separate containers, are not "one host" for us: see shm_setup.cpp). Pages are
// reserved up front (fallocate), so an exhausted memory limit is a clear error when the group is
// formed, never a SIGBUS inside a collective. memfd pages count against memory and the cgroup,
// not against /dev/shm's size, so a container's 64 MiB /dev/shm (vllm#51241) does not limit us.
#pragma once

#include <cstddef>
#include <string>

namespace ddp::shm {

class Segment {
 public:
  Segment() = default;
  ~Segment();
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Creates and maps `bytes` of zeroed shared memory; `name` shows in /proc/<pid>/maps.
  // Throws ddp::Error naming the failing call and errno.
  static Segment create(const std::string& name, size_t bytes);
  // Maps a segment that process `pid` created and still holds open as `fd`.
  static Segment open(int pid, int fd, size_t bytes);

  char* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }
  // Closes the fd; the mapping stays valid. Called once every peer has mapped the segment.
  void close_fd();

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace ddp::shm
