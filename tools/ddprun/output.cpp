// Worker output and the run directory (see output.h).
#include "output.h"

#include "base/log.h"

#include <fcntl.h>   // open, O_* flags
#include <poll.h>    // poll, to wait out EAGAIN
#include <stdlib.h>  // mkdtemp
#include <unistd.h>  // read, write

#include <cctype>  // std::isalnum
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <utility>  // std::move
#include <vector>

#include <fmt/format.h>

#include "ddp/env.h"

namespace ddp::launcher {
namespace {

constexpr std::size_t kReadChunk = 64 * 1024;
constexpr int kMaxChunksPerWake = 16;  // so one chatty worker cannot starve the loop
constexpr int kMaxChunksAtEnd = 1024;  // 64 MiB: bounds the drain of a pipe an escapee holds
constexpr std::size_t kTailLineBytes = 400;

// A run id as a file name: anything but [A-Za-z0-9._-] becomes '_'.
std::string sanitize(const std::string& name) {
  std::string out = name;
  for (char& c : out) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) c = '_';
  }
  return out.empty() ? "run" : out;
}

}  // namespace

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

void note(const std::string& line) { log::tool("ddprun", line); }  // Note [Logging]

// ---------------------------------------------------------------------------------------------
// Stream

Stream::Stream(std::string prefix, int console_fd, UniqueFd file, std::size_t tail_lines)
    : prefix_(std::move(prefix)), file_(std::move(file)), tail_lines_(tail_lines),
      console_fd_(console_fd) {}

void Stream::pump() { read_some(kMaxChunksPerWake); }

void Stream::drain() {
  read_some(kMaxChunksAtEnd);
  pipe_.reset();
  if (!partial_.empty()) {
    std::string out;
    emit_line(partial_, out);
    partial_.clear();
    write_console(out);
  }
}

void Stream::read_some(int max_chunks) {
  char buf[kReadChunk];
  for (int i = 0; pipe_.get() >= 0 && i < max_chunks; ++i) {
    ssize_t n = ::read(pipe_.get(), buf, sizeof buf);
    if (n > 0) {
      feed(std::string_view(buf, static_cast<std::size_t>(n)));
    } else if (n == 0) {
      pipe_.reset();  // EOF: every writer is gone
    } else if (errno != EINTR) {
      return;  // EAGAIN: nothing more for now
    }
  }
}

void Stream::feed(std::string_view chunk) {
  if (file_.get() >= 0) write_all(file_.get(), chunk);
  partial_.append(chunk);
  std::string out;  // all complete lines of this chunk, written at once
  std::size_t start = 0;
  for (auto nl = partial_.find('\n'); nl != std::string::npos; nl = partial_.find('\n', start)) {
    emit_line(std::string_view(partial_).substr(start, nl - start), out);
    start = nl + 1;
  }
  partial_.erase(0, start);
  if (partial_.size() >= kMaxLineBytes) {  // a line without end: show it in pieces
    emit_line(partial_, out);
    partial_.clear();
  }
  write_console(out);
}

void Stream::emit_line(std::string_view line, std::string& out) {
  if (console_fd_ >= 0) {
    out += prefix_;
    out += line;
    out += '\n';
  }
  if (tail_lines_ > 0) {
    tail_.emplace_back(line.substr(0, kTailLineBytes));
    if (tail_.size() > tail_lines_) tail_.pop_front();
  }
}

void Stream::write_console(const std::string& out) {
  if (console_fd_ >= 0 && !out.empty() && !write_all(console_fd_, out)) {
    console_fd_ = -1;  // the console is gone; keep the workers running
  }
}

// ---------------------------------------------------------------------------------------------
// RunDirectory

RunDirectory::RunDirectory(const LaunchConfig& config, const std::string& run_id) {
  std::string name_template;
  bool temporary = false;
  if (!config.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(config.log_dir, ec);
    if (ec) {
      throw ConfigError(
          fmt::format("--log-dir {}: cannot create it: {}", config.log_dir, ec.message()));
    }
    name_template = fmt::format("{}/{}_XXXXXX", config.log_dir, sanitize(run_id));
  } else {
    const std::string parent = env_knob("TMPDIR").value_or("/tmp");
    name_template = fmt::format("{}/ddprun_{}_XXXXXX", parent, sanitize(run_id));
    temporary = true;
  }
  std::vector<char> buf(name_template.begin(), name_template.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) throw_errno("cannot create " + name_template);
  path_ = buf.data();
  keep_ = !temporary || config.any_log_files();
}

RunDirectory::~RunDirectory() {
  if (!keep_) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
}

std::string RunDirectory::rank_dir(int attempt, int local_rank) const {
  std::string dir = fmt::format("{}/attempt_{}/{}", path_, attempt, local_rank);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("cannot create {}: {}", dir, ec.message()));
  return dir;
}

// ---------------------------------------------------------------------------------------------

UniqueFd open_log(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw_errno("cannot open " + path);
  return fd;
}

std::string read_small_file(const std::string& path, std::size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::string data(max_bytes, '\0');
  in.read(data.data(), static_cast<std::streamsize>(max_bytes));
  data.resize(static_cast<std::size_t>(in.gcount()));
  return data;
}

}  // namespace ddp::launcher
