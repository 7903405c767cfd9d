// Atomic writes and raw reads for checkpoint files (see file_io.h).
#include "checkpoint/file_io.h"

#include <fcntl.h>     // open, O_* flags
#include <sys/stat.h>  // mode bits
#include <unistd.h>    // write, pread, fsync, close, link, unlink, getpid

#include <atomic>
#include <cerrno>
#include <cstdio>  // std::rename, renameat2
#include <cstring>  // strerror_r

#include <fmt/format.h>

#include "base/file_size_limit.h"  // FileSizeSignalBlocked: EFBIG under ulimit -f
#include "ddp/checkpoint.h"        // CheckpointError

namespace ddp::ckpt {
namespace {

constexpr std::string_view kTempMarker = ".ckpt.tmp.";

[[noreturn]] void fail(const fs::path& file, std::string_view what, int err) {
  throw CheckpointError(fmt::format("{}: {}: {}", file.string(), what, errno_text(err)));
}

void call(const FaultHook& hook, std::string_view stage, const fs::path& file) {
  if (hook) hook(stage, file);
}

// Writes all of it (SIGXFSZ blocked by the caller: Note [File-size limit] in
// base/file_size_limit.h). `total_bytes` is the whole file's size, for the message.
void write_all(int fd, const fs::path& file, const char* data, size_t size, uint64_t total_bytes) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EFBIG) {
        throw CheckpointError(fmt::format("{}: checkpoint write failed: file too large: {}",
                                          file.string(), base::file_too_large_reason(total_bytes)));
      }
      fail(file, "cannot write the checkpoint", errno);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// The temporary's name in `file`'s directory. The counter keeps names unique within a process.
fs::path temp_path_for(const fs::path& file) {
  return file.parent_path() / temp_name_for(file.filename().string());
}

// Removes the temporary unless it was renamed (the guard is released after a successful
// rename).
struct TempGuard {
  fs::path path;
  bool armed = true;
  ~TempGuard() {
    if (armed) ::unlink(path.c_str());
  }
};

// The complete temporary renamed over `file` (disarming its guard), then `dir` fsync'ed.
void rename_into_place(TempGuard& temp, const fs::path& file, const fs::path& dir) {
  if (std::rename(temp.path.c_str(), file.c_str()) != 0) {
    fail(file, fmt::format("cannot rename {} into place", temp.path.filename().string()), errno);
  }
  temp.armed = false;
  sync_dir(dir);
}

}  // namespace

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

std::string errno_text(int err) {
  char buf[256];
  // GNU strerror_r returns the message (maybe not in buf).
  const char* msg = strerror_r(err, buf, sizeof(buf));
  return fmt::format("{} (errno {})", msg, err);
}

std::string temp_name_for(std::string_view final_name) {
  static std::atomic<uint64_t> counter{0};
  return fmt::format(".{}.tmp.{}.{}", final_name, static_cast<long>(::getpid()), counter++);
}

bool is_temp_name(std::string_view name) {
  return name.size() > 1 && name[0] == '.' && name.find(kTempMarker) != std::string_view::npos;
}

void sync_dir(const fs::path& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) fail(dir, "cannot open the directory to sync it", errno);
  if (::fsync(fd.get()) != 0) fail(dir, "cannot sync the directory", errno);
}

void write_atomic(const fs::path& file, const std::vector<std::string_view>& parts,
                  const FaultHook& hook) {
  const fs::path dir = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  TempGuard temp{temp_path_for(file)};
  call(hook, "open", file);
  // O_EXCL: never write through a name someone else holds.
  Fd fd(::open(temp.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    const int err = errno;
    temp.armed = false;  // not ours
    const bool read_only = err == EACCES || err == EROFS || err == EPERM;
    fail(file,
         fmt::format("cannot create the temporary file {}{}", temp.path.string(),
                     read_only ? " (the checkpoint directory is not writable by this process; "
                                 "earlier checkpoints in it are untouched)"
                               : ""),
         err);
  }
  size_t total = 0;
  for (auto p : parts) total += p.size();
  const base::FileSizeSignalBlocked no_sigxfsz;  // EFBIG instead of death by SIGXFSZ
  size_t written = 0;
  bool hooked = false;
  for (auto p : parts) {
    // The "write" stage fires once half the bytes are on their way (a partial temporary).
    size_t at = 0;
    if (!hooked && written + p.size() >= total / 2) {
      at = total / 2 - written;
      write_all(fd.get(), file, p.data(), at, total);
      call(hook, "write", file);
      hooked = true;
    }
    write_all(fd.get(), file, p.data() + at, p.size() - at, total);
    written += p.size();
  }
  if (!hooked) call(hook, "write", file);
  call(hook, "fsync", file);
  if (::fsync(fd.get()) != 0) fail(file, "cannot fsync the checkpoint", errno);
  if (::close(fd.release()) != 0) fail(file, "cannot close the checkpoint", errno);
  call(hook, "rename", file);
  if (std::rename(temp.path.c_str(), file.c_str()) != 0) {
    fail(file, fmt::format("cannot rename {} into place", temp.path.filename().string()), errno);
  }
  temp.armed = false;
  call(hook, "sync_dir", file);
  sync_dir(dir);
}

bool link_atomic(const fs::path& target, const fs::path& link, const FaultHook& hook) {
  const fs::path dir = link.parent_path().empty() ? fs::path(".") : link.parent_path();
  TempGuard temp{temp_path_for(link)};
  call(hook, "last", link);
  if (::link(target.c_str(), temp.path.c_str()) != 0) {
    const int err = errno;
    temp.armed = false;
    if (err == EPERM || err == EXDEV || err == EOPNOTSUPP || err == EMLINK || err == ENOSYS) {
      return false;
    }
    fail(link, fmt::format("cannot link it to {}", target.filename().string()), err);
  }
  rename_into_place(temp, link, dir);
  return true;
}

void symlink_atomic(const std::string& target_name, const fs::path& link, const FaultHook& hook) {
  const fs::path dir = link.parent_path().empty() ? fs::path(".") : link.parent_path();
  TempGuard temp{temp_path_for(link)};
  call(hook, "last", link);
  if (::symlink(target_name.c_str(), temp.path.c_str()) != 0) {
    const int err = errno;
    temp.armed = false;
    fail(link, fmt::format("cannot make it a symbolic link to {}", target_name), err);
  }
  rename_into_place(temp, link, dir);
}

fs::path make_temp_dir(const fs::path& final_dir) {
  const fs::path temp = temp_path_for(final_dir);
  if (::mkdir(temp.c_str(), 0755) != 0) {
    fail(final_dir, fmt::format("cannot create the directory {}", temp.filename().string()), errno);
  }
  return temp;
}

void publish_dir(const fs::path& from, const fs::path& to) {
  const fs::path dir = to.parent_path().empty() ? fs::path(".") : to.parent_path();
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    const int err = errno;
    if (err != ENOTEMPTY && err != EEXIST && err != EISDIR && err != ENOTDIR) {
      fail(to, fmt::format("cannot rename {} into place", from.filename().string()), err);
    }
    // A checkpoint of that name exists (the same step saved again): swap the two names in one
    // step, then remove the old one, now under the temporary name.
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0) {
      fail(to,
           fmt::format("cannot swap {} into place of the existing checkpoint",
                       from.filename().string()),
           errno);
    }
    std::error_code ec;
    fs::remove_all(from, ec);  // the old one; a failure leaves a temporary the next save removes
  }
  sync_dir(dir);
}

bool remove_checkpoint(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(path, ec))) return ::unlink(path.c_str()) == 0;
  const fs::path temp = temp_path_for(path);
  if (std::rename(path.c_str(), temp.c_str()) != 0) return false;
  fs::remove_all(temp, ec);
  return true;
}

uint64_t read_at(int fd, const fs::path& path, uint64_t offset, void* out, uint64_t size) {
  auto* dst = static_cast<char*>(out);
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, dst + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, "cannot read the checkpoint", errno);
    }
    if (n == 0) break;
    done += static_cast<uint64_t>(n);
  }
  return done;
}

}  // namespace ddp::ckpt
