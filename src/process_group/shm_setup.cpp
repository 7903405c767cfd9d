// Forming the shared-memory transport (see shm_setup.h).
#include "process_group/shm_setup.h"

#include <unistd.h>  // getpid, readlink

#include <algorithm>
#include <cstdio>   // sscanf
#include <cstdlib>  // getenv, strtoll
#include <fstream>

#include <ATen/ops/from_blob.h>
#include <fmt/format.h>

#include "base/check.h"
#include "base/log.h"
#include "base/net.h"  // host_name
#include "process_group/store_exchange.h"

namespace ddp {
namespace {

using store_exchange::bytes_of;
using store_exchange::exchange;
using store_exchange::text_of;

// Test knob: a tiny chunk forces many chunks per collective (DDP_SHM_CHUNK_BYTES).
size_t chunk_bytes(int size) {
  const std::optional<std::string> v = env_knob("DDP_SHM_CHUNK_BYTES");
  if (!v) return size == 1 ? 64 : shm::kDefaultChunkBytes;  // one rank stages nothing
  char* end = nullptr;
  const long long b = std::strtoll(v->c_str(), &end, 10);
  DDP_CHECK(*end == '\0' && b >= 64 * size && b % 64 == 0, ConfigError,
            "DDP_SHM_CHUNK_BYTES={} must be a multiple of 64 and at least 64 x world size ({})", *v,
            64 * size);
  return static_cast<size_t>(b);
}

}  // namespace

// Ranks may share memory when they run on the same kernel (boot id) in the same pid namespace
// (a peer opens /proc/<pid>/fd/<fd> of the segment's creator). Hostnames alone lie: containers
// on one host can share a hostname, and one container can see another's name.
std::string host_identity() {
  const std::string host = net::host_name();
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  char ns[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return fmt::format("{} {} {} uid {}", host, boot_id, n > 0 ? std::string(ns, n) : "?", getuid());
}

bool Locality::uniform() const {
  return std::all_of(host_size.begin(), host_size.end(),
                     [&](int n) { return n == host_size.front(); });
}

std::vector<int> Locality::ranks_on(int h) const {
  std::vector<int> out;
  for (size_t r = 0; r < host.size(); ++r) {
    if (host[r] == h) out.push_back(static_cast<int>(r));
  }
  return out;
}

Locality exchange_locality(::c10d::Store& store, const DistEnv& env,
                           const std::optional<std::string>& host_id) {
  const int n = env.world_size;
  const std::string me = host_id ? "host_id " + *host_id : host_identity();
  const std::vector<std::string> ids = exchange(store, "shm/host", env.rank, n, me);
  Locality out;
  std::vector<std::string> seen;  // identity of each host, by host index
  for (int r = 0; r < n; ++r) {
    auto it = std::find(seen.begin(), seen.end(), ids[r]);
    const int h = static_cast<int>(it - seen.begin());
    if (it == seen.end()) {
      seen.push_back(ids[r]);
      out.host_size.push_back(0);
    }
    out.host.push_back(h);
    out.local_rank.push_back(out.host_size[h]++);
    if (h > 0 && out.first_difference.empty()) {
      out.first_difference =
          fmt::format("ranks 0 and {} are on different hosts ('{}' vs '{}')", r, seen[0], ids[r]);
    }
  }
  return out;
}

ShmSetup make_shm_group(::c10d::Store& store, const ShmPeers& peers,
                        std::chrono::milliseconds timeout) {
  const int rank = peers.rank;
  const int n = peers.size;
  shm::Options o{rank, n, timeout, chunk_bytes(n), peers.global};
  const size_t size = shm::Group::segment_bytes(n, o.chunk_bytes);
  const auto key = [&](const std::string& what) { return peers.prefix + what; };

  // 1. Local rank 0 creates the segment; the others map it through /proc/<pid>/fd/<fd>.
  shm::Segment segment;
  std::string status = "ok";
  if (rank == 0) {
    try {
      segment = shm::Segment::create(fmt::format("ddp-shm-{}", peers.run_id), size);
    } catch (const std::exception& e) {
      status = e.what();
    }
    if (n > 1) {
      store.set(key("segment"),
                bytes_of(status == "ok" ? fmt::format("ok {} {}", getpid(), segment.fd())
                                        : "error " + status));
    }
  } else {
    const std::string where = text_of(store.get(key("segment")));
    int pid = 0, fd = -1;
    if (where.starts_with("error ")) {
      status =
          fmt::format("rank {} could not create the segment: {}", peers.global[0], where.substr(6));
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
  }
  // 2. Every peer learns whether every peer mapped it (so all fall back together); the
  // creator may close its fd after that.
  std::string first_error;
  const std::vector<std::string> mapped = exchange(store, key("mapped"), rank, n, status);
  for (int r = 0; r < n && first_error.empty(); ++r) {
    if (mapped[r] != "ok") first_error = fmt::format("rank {}: {}", peers.global[r], mapped[r]);
  }
  segment.close_fd();
  ShmSetup out;
  if (!first_error.empty()) {
    out.why_not = fmt::format("cannot share a memory segment ({})", first_error);
    return out;
  }
  out.group = std::make_shared<shm::Group>(o, std::move(segment));
  return out;
}

std::shared_ptr<shm::SharedBuffer> make_shared_buffer(::c10d::Store& store, shm::Group& group,
                                                      const ShmPeers& peers, uint64_t id,
                                                      size_t bytes) {
  const int rank = peers.rank;
  const int n = peers.size;
  auto buffer = std::make_shared<shm::SharedBuffer>();
  buffer->id = id;
  buffer->bytes = bytes;
  buffer->base.assign(n, nullptr);
  buffer->parts.resize(n);
  const auto key = [&](const char* what) {
    return fmt::format("{}buffer/{}/{}", peers.prefix, id, what);
  };

  // 1. Every rank creates its part and says where it is (or why it could not). Every rank checks
  // every size, so a mismatch fails on every rank: nobody leaves before all have read.
  std::string status = "ok";
  try {
    buffer->parts[rank] =
        shm::Segment::create(fmt::format("ddp-shm-{}-buffer-{}", peers.run_id, id), bytes);
    buffer->base[rank] = buffer->parts[rank].data();
  } catch (const std::exception& e) {
    status = e.what();
  }
  const std::vector<std::string> parts =
      exchange(store, key("part"), rank, n,
               status == "ok"
                   ? fmt::format("ok {} {} {}", getpid(), buffer->parts[rank].fd(), bytes)
                   : fmt::format("error {} {}", bytes, status),
               store_exchange::Linger::kUntilAllRead);
  // 2. Every rank maps every peer's part.
  for (int r = 0; r < n; ++r) {
    if (r == rank) continue;
    const std::string& where = parts[r];
    int pid = 0, fd = -1;
    unsigned long long theirs = 0;
    const bool ok = std::sscanf(where.c_str(), "ok %d %d %llu", &pid, &fd, &theirs) == 3;
    if (!ok) std::sscanf(where.c_str(), "error %llu", &theirs);
    DDP_CHECK(theirs == bytes, Error,
              "[rank {}] comm buffer #{}: this rank asked for {} bytes, rank {} for {}. "
              "ProcessGroup::comm_buffer is collective: every rank must allocate the same "
              "buffers in the same order.",
              peers.global[rank], id, bytes, peers.global[r], theirs);
    if (status != "ok") continue;  // checked the sizes; nothing to map
    if (!ok) {
      status = fmt::format("rank {}: {}", peers.global[r], where.substr(where.find(' ', 6) + 1));
      continue;
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
  const std::vector<std::string> mapped = exchange(store, key("mapped"), rank, n, status);
  for (int r = 0; r < n && status == "ok"; ++r) {
    if (mapped[r] != "ok") status = fmt::format("rank {}: {}", peers.global[r], mapped[r]);
  }
  buffer->parts[rank].close_fd();
  if (status != "ok") {
    if (rank == 0) {
      log::note(peers.global[rank],
                "comm buffer #{} ({:.1f} MiB) is in private memory: {}; its collectives copy "
                "through the staging areas",
                id, bytes / 1048576.0, status);
    }
    return nullptr;
  }
  group.register_buffer(buffer);
  return buffer;
}

ShmCommBuffers::ShmCommBuffers(c10::intrusive_ptr<::c10d::Store> store,
                               std::shared_ptr<shm::Group> group, ShmPeers peers)
    : store_(std::move(store)), group_(std::move(group)), peers_(std::move(peers)) {}

at::Tensor ShmCommBuffers::make(uint64_t id, int64_t numel,
                                const at::TensorOptions& options) const {
  if (!options.device().is_cpu() || numel == 0 || peers_.size == 1) return {};
  const size_t bytes =
      static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  std::shared_ptr<shm::SharedBuffer> buffer =
      make_shared_buffer(*store_, *group_, peers_, id, bytes);
  if (!buffer) return {};
  char* mine = buffer->base[peers_.rank];  // zeroed: a fresh memfd
  return at::from_blob(
      mine, {numel}, [buffer](void*) mutable { buffer.reset(); }, options);
}

bool ShmCommBuffers::holds(const at::Tensor& t) const {
  if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) return false;
  return group_->find(t.data_ptr(), t.numel() * t.element_size()).buffer != nullptr;
}

}  // namespace ddp
