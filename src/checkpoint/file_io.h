// POSIX file plumbing for checkpoints: atomic writes, whole-range reads, temporary-file names.
// Torch-free.
//
// Note [Atomic checkpoint write]
// A file is written to a temporary ".<name>.tmp.<pid>.<n>" in the same directory, fsync'ed,
// renamed over <name>, and the directory is fsync'ed. A crash or an error at any point leaves
// either the old <name> or the complete new one, never a mix; an existing checkpoint is not
// touched until its replacement is complete on disk. A failed write removes its temporary file;
// a crash can leave one behind: readers ignore them and the next Checkpointer::save (or
// remove_stale_temp_files) deletes them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::ckpt {

namespace fs = std::filesystem;

// Testing hook (CheckpointerOptions::fault_hook): called at each stage of a write.
using FaultHook = std::function<void(std::string_view stage, const fs::path& file)>;

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// "No such file or directory (errno 2)".
std::string errno_text(int err);

// Writes the concatenation of `parts` to `file` atomically: temporary in the same directory,
// write, fsync, rename, fsync the directory. On failure removes the temporary and throws
// CheckpointError naming `file`, the step and the system error. `hook` may be empty.
void write_atomic(const fs::path& file, const std::vector<std::string_view>& parts,
                  const FaultHook& hook);

// Makes `link` another name of `target` (a hard link) atomically: link to a temporary, rename
// over `link`, fsync the directory. Returns false (and changes nothing) when the file system
// does not support hard links; throws CheckpointError on other failures.
bool link_atomic(const fs::path& target, const fs::path& link, const FaultHook& hook);

// Makes `link` a symbolic link to `target_name` (a name in the same directory) atomically: a
// temporary link renamed over `link`, then the directory fsync'ed. Throws CheckpointError.
void symlink_atomic(const std::string& target_name, const fs::path& link, const FaultHook& hook);

// A new, empty temporary directory for `final_dir` (temp_name_for's name, beside it). Throws
// CheckpointError.
fs::path make_temp_dir(const fs::path& final_dir);

// Renames the complete directory `from` to `to` (a file or directory of that name is replaced:
// swapped atomically, then removed), then fsyncs the parent. Throws CheckpointError.
void publish_dir(const fs::path& from, const fs::path& to);

// Removes a file, or a directory and everything in it: first renamed to a temporary name, so
// that a crash half way leaves no damaged checkpoint under its name. Returns false (errno set)
// when it could not.
bool remove_checkpoint(const fs::path& path);

// fsync of a directory, so that a rename in it is durable. Throws CheckpointError.
void sync_dir(const fs::path& dir);

// Reads exactly `size` bytes at `offset` into `out`; returns the number read (< size only at
// end of file). Throws CheckpointError naming `path` on an I/O error.
uint64_t read_at(int fd, const fs::path& path, uint64_t offset, void* out, uint64_t size);

// ".epoch=1-step=20.ckpt.tmp.<pid>.<n>" for "epoch=1-step=20.ckpt": hidden, never matched as
// a checkpoint, unique within the host.
std::string temp_name_for(std::string_view final_name);
// True for names temp_name_for() produces.
bool is_temp_name(std::string_view name);

}  // namespace ddp::ckpt
