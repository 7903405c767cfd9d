// Forming the shared-memory transport (see shm_setup.h).
#include "process_group/shm_setup.h"

#include <unistd.h>  // gethostname, getpid, readlink

#include <cstdio>   // sscanf
#include <cstdlib>  // getenv, strtoll
#include <fstream>

#include <fmt/format.h>

#include "base/check.h"

namespace ddp {
namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Ranks may share memory when they run on the same kernel (boot id) in the same pid namespace
// (a peer opens /proc/<pid>/fd/<fd> of the segment's creator). Hostnames alone lie: containers
// on one host can share a hostname, and one container can see another's name.
std::string host_identity() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  char ns[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return fmt::format("{} {} {} uid {}", host, boot_id, n > 0 ? std::string(ns, n) : "?",
                     getuid());
}

// Test knob: a tiny chunk forces many chunks per collective (DDP_SHM_CHUNK_BYTES).
size_t chunk_bytes(int size) {
  const char* v = std::getenv("DDP_SHM_CHUNK_BYTES");
  if (v == nullptr) return size == 1 ? 64 : shm::kDefaultChunkBytes;  // one rank stages nothing
  char* end = nullptr;
  const long long b = std::strtoll(v, &end, 10);
  DDP_CHECK(*v != '\0' && *end == '\0' && b >= 64 * size && b % 64 == 0, ConfigError,
            "DDP_SHM_CHUNK_BYTES={} must be a multiple of 64 and at least 64 x world size ({})",
            v, 64 * size);
  return static_cast<size_t>(b);
}

}  // namespace

ShmSetup make_shm_group(::c10d::Store& store, const DistEnv& env,
                        std::chrono::milliseconds timeout) {
  const int rank = env.rank;
  const int n = env.world_size;
  shm::Options o{rank, n, timeout, chunk_bytes(n)};
  const size_t size = shm::Group::segment_bytes(n, o.chunk_bytes);
  ShmSetup out;

  // 1. One host?
  const std::string me = host_identity();
  if (n > 1) {
    store.set(fmt::format("shm/host/{}", rank), bytes_of(me));
    for (int r = 0; r < n; ++r) {
      const std::string theirs = r == rank ? me : text(store.get(fmt::format("shm/host/{}", r)));
      if (theirs != me && out.why_not.empty()) {
        out.why_not = fmt::format("ranks {} and {} are on different hosts ('{}' vs '{}')",
                                  std::min(r, rank), std::max(r, rank),
                                  r < rank ? theirs : me, r < rank ? me : theirs);
      }
    }
    // Every rank compared every identity with its own: if any pair differs, rank 0 saw it too
    // (transitivity), and all ranks fall back together.
    if (!out.why_not.empty()) return out;
  }

  // 2. Rank 0 creates the segment; the others map it through /proc/<pid>/fd/<fd>.
  shm::Segment segment;
  std::string status = "ok";
  if (rank == 0) {
    try {
      segment = shm::Segment::create(fmt::format("ddp-shm-{}", env.run_id), size);
    } catch (const std::exception& e) {
      status = e.what();
    }
    if (n > 1) {
      store.set("shm/segment", bytes_of(status == "ok"
                                         ? fmt::format("ok {} {}", getpid(), segment.fd())
                                         : "error " + status));
    }
  } else {
    const std::string where = text(store.get("shm/segment"));
    int pid = 0, fd = -1;
    if (where.starts_with("error ")) {
      status = "rank 0 could not create the segment: " + where.substr(6);
    } else if (std::sscanf(where.c_str(), "ok %d %d", &pid, &fd) != 2) {
      status = fmt::format("malformed segment record '{}'", where);
    } else {
      try {
        segment = shm::Segment::open(pid, fd, size);
        segment.close_fd();
      } catch (const std::exception& e) {
        status = e.what();
      }
    }
    store.set(fmt::format("shm/mapped/{}", rank), bytes_of(status));
  }
  // 3. Everyone learns whether every rank mapped it; rank 0 may close its fd after that.
  std::string first_error = rank == 0 && status != "ok" ? "rank 0: " + status : "";
  if (n > 1 && first_error.empty()) {
    for (int r = 1; r < n; ++r) {
      const std::string s = text(store.get(fmt::format("shm/mapped/{}", r)));
      if (s != "ok") {
        first_error = fmt::format("rank {}: {}", r, s);
        break;
      }
    }
  }
  segment.close_fd();
  if (!first_error.empty()) {
    out.why_not = fmt::format("cannot share a memory segment ({})", first_error);
    return out;
  }
  out.group = std::make_shared<shm::Group>(o, std::move(segment));
  return out;
}

std::shared_ptr<shm::SharedBuffer> make_shared_buffer(::c10d::Store& store, shm::Group& group,
                                                      const DistEnv& env, uint64_t id,
                                                      size_t bytes) {
  const int rank = env.rank;
  const int n = env.world_size;
  auto buffer = std::make_shared<shm::SharedBuffer>();
  buffer->id = id;
  buffer->bytes = bytes;
  buffer->base.assign(n, nullptr);
  buffer->parts.resize(n);
  const auto key = [&](const char* what, int r) {
    return fmt::format("shm/buffer/{}/{}/{}", id, what, r);
  };

  // 1. Every rank creates its part and says where it is (or why it could not).
  std::string status = "ok";
  try {
    buffer->parts[rank] =
        shm::Segment::create(fmt::format("ddp-shm-{}-buffer-{}", env.run_id, id), bytes);
    buffer->base[rank] = buffer->parts[rank].data();
  } catch (const std::exception& e) {
    status = e.what();
  }
  if (n > 1) {
    store.set(key("part", rank),
              bytes_of(status == "ok" ? fmt::format("ok {} {} {}", getpid(),
                                                    buffer->parts[rank].fd(), bytes)
                                      : fmt::format("error {} {}", bytes, status)));
  }
  // 2. Every rank maps every peer's part.
  for (int r = 0; r < n && status == "ok"; ++r) {
    if (r == rank) continue;
    const std::string where = text(store.get(key("part", r)));
    int pid = 0, fd = -1;
    unsigned long long theirs = 0;
    const bool ok = std::sscanf(where.c_str(), "ok %d %d %llu", &pid, &fd, &theirs) == 3;
    if (!ok) std::sscanf(where.c_str(), "error %llu", &theirs);
    DDP_CHECK(theirs == bytes, Error,
              "[rank {}] comm buffer #{}: this rank asked for {} bytes, rank {} for {}. "
              "ProcessGroup::comm_buffer is collective: every rank must allocate the same "
              "buffers in the same order.",
              rank, id, bytes, r, theirs);
    if (!ok) {
      status = fmt::format("rank {}: {}", r, where.substr(where.find(' ', 6) + 1));
      break;
    }
    try {
      buffer->parts[r] = shm::Segment::open(pid, fd, bytes);
      buffer->parts[r].close_fd();
      buffer->base[r] = buffer->parts[r].data();
    } catch (const std::exception& e) {
      status = e.what();
    }
  }
  // 3. Everyone learns whether every rank mapped everything; then the creators close their fds.
  if (n > 1) {
    store.set(key("mapped", rank), bytes_of(status));
    for (int r = 0; r < n && status == "ok"; ++r) {
      if (r == rank) continue;
      const std::string theirs = text(store.get(key("mapped", r)));
      if (theirs != "ok") status = fmt::format("rank {}: {}", r, theirs);
    }
    // A rank that failed at step 2 skipped the others' records; it still must not leave
    // before they have read its own, so it reads them too.
    for (int r = 0; r < n && status != "ok"; ++r) {
      if (r != rank) store.get(key("mapped", r));
    }
  }
  buffer->parts[rank].close_fd();
  if (status != "ok") {
    if (rank == 0) {
      fmt::print(stderr,
                 "ddp: comm buffer #{} ({:.1f} MiB) is in private memory: {}; its collectives "
                 "copy through the staging areas\n",
                 id, bytes / 1048576.0, status);
    }
    return nullptr;
  }
  group.register_buffer(buffer);
  return buffer;
}

}  // namespace ddp
