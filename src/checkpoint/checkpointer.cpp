// Checkpointer: a directory of checkpoints (Note [Checkpoint directory]) and the collective
// protocol around it (see "Collective behaviour" in ddp/checkpoint.h).
#include <sys/stat.h>  // stat: is last.ckpt the same file as a step checkpoint?
#include <unistd.h>    // unlink

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <exception>
#include <system_error>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "checkpoint/file_io.h"
#include "checkpoint/metadata.h"  // check_save_args
#include "checkpoint/sharded.h"
#include "ddp/checkpoint.h"
#include "ddp/process_group.h"
#include "ddp/relayed_error.h"  // Relayed: a failure announced by another rank
#include "ddp/run_lease.h"      // RunLease::check before publishing a file
#include "process_group/bytes_collectives.h"
#include "state/shards.h"  // rank_snapshot

namespace ddp {
namespace {

namespace fs = std::filesystem;

// --- names ----------------------------------------------------------------------------------

// "epoch=E-step=S.ckpt" -> (step, epoch); nullopt for any other name.
std::optional<std::pair<int64_t, int64_t>> parse_name(std::string_view name) {
  constexpr std::string_view kEpoch = "epoch=", kStep = "-step=", kExt = ".ckpt";
  if (!name.starts_with(kEpoch) || !name.ends_with(kExt)) return std::nullopt;
  name.remove_prefix(kEpoch.size());
  name.remove_suffix(kExt.size());
  const size_t dash = name.find(kStep);
  if (dash == std::string_view::npos) return std::nullopt;
  auto number = [](std::string_view s) -> std::optional<int64_t> {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc() || end != s.data() + s.size() || v < 0) return {};
    return v;
  };
  auto epoch = number(name.substr(0, dash));
  auto step = number(name.substr(dash + kStep.size()));
  if (!epoch || !step) return std::nullopt;
  return std::make_pair(*step, *epoch);
}

// The reason without the leading "<path>: " the error messages start with.
std::string reason_of(const std::exception& e, const fs::path& path) {
  std::string_view msg = e.what();
  const std::string prefix = path.string() + ": ";
  if (msg.starts_with(prefix)) msg.remove_prefix(prefix.size());
  return std::string(msg);
}

struct Candidate {
  fs::path path;
  int64_t step = 0;
  int64_t epoch = 0;
  bool is_last = false;
};

bool same_file(const fs::path& a, const fs::path& b) {
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

void remove_temp_dir(const fs::path& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);  // a failure leaves a temporary directory the next save removes
}

// A sharded save after its first phase (Note [Sharded checkpoint]).
struct ShardedSave {
  fs::path temp_dir;
  Snapshot mine;                      // rank 0: the replicated and collective states
  std::vector<ckpt::RankFile> files;  // every rank's file, by rank
  bool published = false;
};

// The first phase of a sharded save, on every rank: rank 0 makes the temporary directory, every
// rank writes its file into it, and the ranks exchange how it went. When any rank failed,
// rank 0 removes the directory and every rank throws: the failed rank its own error, the
// others an error naming it.
ShardedSave save_rank_files(const Checkpointer& c, TrainingState& state, const CheckpointMeta& meta,
                            ProcessGroup* group, const fs::path& final_path,
                            const ckpt::FaultHook& hook) {
  const int rank = group ? group->rank() : 0;
  ShardedSave out;
  std::exception_ptr error;
  // A state_dict() that throws on one rank must not leave the others waiting: the failure
  // rides through the protocol below to every rank.
  try {
    out.mine = group ? state::rank_snapshot(state, *group) : state.snapshot();
  } catch (...) {
    error = std::current_exception();
  }
  std::string name;
  if (rank == 0 && !error) {
    try {
      c.remove_stale_temp_files();
      out.temp_dir = ckpt::make_temp_dir(final_path);
      name = out.temp_dir.filename().string();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (group) {
    const int64_t size = broadcast_i64(*group, error ? -1 : static_cast<int64_t>(name.size()));
    if (size < 0) {
      if (error) std::rethrow_exception(error);
      throw Relayed<CheckpointError>(
          0, fmt::format("[rank {}] checkpoint save: rank 0 could not make the directory of {} "
                         "(its error says why)",
                         rank, final_path.string()));
    }
    name = broadcast_bytes(*group, name, size);
    out.temp_dir = c.dir() / name;
  } else if (error) {
    std::rethrow_exception(error);
  }
  nlohmann::json mine = {{"ok", false}};
  try {
    if (error) std::rethrow_exception(error);
    std::error_code ec;
    if (!fs::is_directory(out.temp_dir, ec)) {
      throw CheckpointError(fmt::format(
          "[rank {}] {}: rank 0 made this directory for a sharded checkpoint, but it is not "
          "there on this rank's host: every rank writes its own file into it, so the "
          "checkpoint directory must be one that every rank shares (a shared file system); "
          "else save one-file checkpoints (CheckpointerOptions::sharded = false, ddp-train "
          "--checkpoint-format full)",
          rank, out.temp_dir.string()));
    }
    const ckpt::RankFile f = ckpt::write_rank_file(out.temp_dir, rank, out.mine, meta, hook);
    mine = {{"ok", true}, {"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}};
  } catch (...) {
    error = std::current_exception();
  }
  std::erase_if(out.mine.entries,
                [](const Snapshot::Entry& e) { return state::saved_by_each_rank(e.scope); });
  const std::vector<std::string> all =
      group ? all_gather_bytes(*group, mine.dump()) : std::vector<std::string>{mine.dump()};
  std::vector<int> failed;
  for (size_t r = 0; r < all.size(); ++r) {
    const nlohmann::json j = nlohmann::json::parse(all[r]);
    if (!j.at("ok").get<bool>()) {
      failed.push_back(static_cast<int>(r));
      continue;
    }
    out.files.push_back({j.at("name").get<std::string>(), j.at("bytes").get<uint64_t>(),
                         j.at("sha256").get<std::string>()});
  }
  if (!failed.empty()) {
    if (rank == 0) remove_temp_dir(out.temp_dir);
    if (error) std::rethrow_exception(error);
    throw Relayed<CheckpointError>(
        failed.front(),
        fmt::format("[rank {}] checkpoint save: rank(s) {} could not write their part of {} "
                    "(their errors say why); nothing was published",
                    rank, fmt::join(failed, ", "), final_path.string()));
  }
  return out;
}

}  // namespace

std::string Checkpointer::file_name(int64_t epoch, int64_t step) {
  return fmt::format("epoch={}-step={}.ckpt", epoch, step);
}

Checkpointer::Checkpointer(std::filesystem::path dir, CheckpointerOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {
  if (options_.keep < 0) {
    throw ConfigError(
        fmt::format("Checkpointer: keep = {}; use 0 to keep every checkpoint or "
                    "K > 0 to keep the K newest",
                    options_.keep));
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    throw CheckpointError(
        fmt::format("{}: cannot create the checkpoint directory: {}", dir_.string(), ec.message()));
  }
}

std::vector<fs::path> Checkpointer::list() const {
  std::vector<std::tuple<int64_t, int64_t, fs::path>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const auto parsed = parse_name(it->path().filename().string());
    std::error_code type_ec;
    if (parsed && (it->is_regular_file(type_ec) || it->is_directory(type_ec))) {
      found.emplace_back(parsed->first, parsed->second, it->path());
    }
  }
  if (ec) {
    throw CheckpointError(
        fmt::format("{}: cannot list the checkpoint directory: {}", dir_.string(), ec.message()));
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) > std::tie(std::get<0>(b), std::get<1>(b));
  });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::get<2>(f));
  return out;
}

std::vector<fs::path> Checkpointer::remove_stale_temp_files() const {
  std::vector<fs::path> removed;
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    if (!ckpt::is_temp_name(it->path().filename().string())) continue;
    std::error_code remove_ec;
    if (fs::remove_all(it->path(), remove_ec) > 0 && !remove_ec) removed.push_back(it->path());
  }
  return removed;
}

SavedCheckpoint Checkpointer::save(TrainingState& state, const CheckpointMeta& meta) const {
  return save(state, meta, static_cast<ProcessGroup*>(nullptr));
}

SavedCheckpoint Checkpointer::save(TrainingState& state, const CheckpointMeta& meta,
                                   ProcessGroup& group) const {
  return save(state, meta, &group);
}

// The group is optional in the overloads above; the private forms take it as a pointer.
SavedCheckpoint Checkpointer::save(TrainingState& state, const CheckpointMeta& meta_in,
                                   ProcessGroup* group) const {
  ckpt::check_save_args(&state, meta_in);  // every rank, before any collective
  CheckpointMeta meta = meta_in;
  if (group) meta.world_size = group->size();
  if (meta.model_label.empty()) meta.model_label = options_.model_label;
  SavedCheckpoint out;
  out.path = dir_ / file_name(meta.epoch, meta.step);

  // Note [Run folder lease]: each file is published (renamed, linked) only while this group
  // still holds the folder.
  const ckpt::FaultHook hook = [this](std::string_view stage, const fs::path& file) {
    if (options_.lease && (stage == "rename" || stage == "last")) {
      options_.lease->check(fmt::format("checkpoint {}", file.filename().string()));
    }
    if (options_.fault_hook) options_.fault_hook(stage, file);
  };
  // A sharded save: every rank writes its file first (Note [Sharded checkpoint]).
  std::optional<ShardedSave> sharded;
  if (options_.sharded) sharded = save_rank_files(*this, state, meta, group, out.path, hook);
  // Otherwise every rank takes part (per-rank states gathered, collective ones consolidated);
  // rank 0 holds the whole snapshot. A failure there on rank 0 alone (pieces that do not join)
  // is announced below like a failed write.
  Snapshot snapshot;
  std::exception_ptr error;
  if (!sharded) {
    try {
      snapshot = group ? state.snapshot(*group) : state.snapshot();
    } catch (...) {
      error = std::current_exception();
    }
  }
  if (!error && (!group || group->rank() == 0)) {
    try {
      if (sharded) {
        ckpt::write_sharded_metadata(sharded->temp_dir, sharded->mine, state.keys(), meta,
                                     sharded->files, hook);
        ckpt::sync_dir(sharded->temp_dir);
        hook("rename", out.path);
        ckpt::publish_dir(sharded->temp_dir, out.path);
        sharded->published = true;
        if (options_.save_last) {
          ckpt::symlink_atomic(out.path.filename().string(), last_path(), hook);
        }
      } else {
        remove_stale_temp_files();
        const ckpt::EncodedFile file = ckpt::encode_snapshot(snapshot, meta);
        ckpt::write_atomic(out.path, file.parts(), hook);
        if (options_.save_last) {
          const fs::path last = last_path();
          if (!ckpt::link_atomic(out.path, last, hook)) {
            ckpt::write_atomic(last, file.parts(), hook);
            out.warnings.push_back(
                fmt::format("{}: the file system refuses hard links; wrote a copy", last.string()));
          }
        }
      }
      // Keep-K: the file just written, and the keep-1 newest others.
      int others = 0;
      for (const auto& f : list()) {
        if (f == out.path || options_.keep == 0) continue;
        if (++others < options_.keep) continue;
        if (ckpt::remove_checkpoint(f)) {
          out.removed.push_back(f);
        } else {
          out.warnings.push_back(fmt::format("{}: cannot remove an old checkpoint: {}", f.string(),
                                             ckpt::errno_text(errno)));
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
    if (sharded && !sharded->published) remove_temp_dir(sharded->temp_dir);
  }
  // The outcome, from rank 0: nobody returns before the file is complete, nobody believes in
  // a checkpoint that failed.
  if (group) {
    const int64_t failed = broadcast_i64(*group, error ? 1 : 0);
    if (!error && failed) {
      throw Relayed<CheckpointError>(
          0,
          fmt::format("[rank {}] checkpoint save: rank 0 failed to write {} (its error says why)",
                      group->rank(), out.path.string()));
    }
  }
  if (error) std::rethrow_exception(error);
  return out;
}

namespace {

ResumePoint scan(const Checkpointer& c) {
  ResumePoint out;
  std::vector<Candidate> candidates;
  std::error_code ec;
  for (fs::directory_iterator it(c.dir(), ec), end; !ec && it != end; it.increment(ec)) {
    if (auto parsed = parse_name(it->path().filename().string())) {
      candidates.push_back({it->path(), parsed->first, parsed->second, false});
    }
  }
  if (ec) {
    throw CheckpointError(fmt::format("{}: cannot list the checkpoint directory: {}",
                                      c.dir().string(), ec.message()));
  }
  // last.ckpt is usually a hard link to the newest step file (then skip it: the same bytes);
  // otherwise (a copy, or its step file was removed) it competes by the step in its header.
  const fs::path last = c.last_path();
  if (fs::exists(last, ec)) {
    const bool linked = std::any_of(candidates.begin(), candidates.end(),
                                    [&](const Candidate& k) { return same_file(k.path, last); });
    if (!linked) {
      try {
        const CheckpointMeta m = read_checkpoint_meta(last);
        candidates.push_back({last, m.step, m.epoch, true});
      } catch (const CheckpointError& e) {
        out.skipped.push_back({last, reason_of(e, last)});
      }
    }
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(a.step, a.epoch, b.is_last) > std::tie(b.step, b.epoch, a.is_last);
  });
  for (const auto& k : candidates) {
    try {
      verify_checkpoint(k.path);
      out.path = k.path;
      return out;
    } catch (const CheckpointError& e) {  // damaged, or unreadable: fall back to an older one
      out.skipped.push_back({k.path, reason_of(e, k.path)});
    }
  }
  return out;
}

}  // namespace

ResumePoint Checkpointer::latest_valid() const { return latest_valid(nullptr); }
ResumePoint Checkpointer::latest_valid(ProcessGroup& group) const { return latest_valid(&group); }

ResumePoint Checkpointer::latest_valid(ProcessGroup* group) const {
  if (!group) return scan(*this);
  ResumePoint out;
  std::exception_ptr error;
  std::string name;
  if (group->rank() == 0) {
    try {
      out = scan(*this);
      if (out.path) name = out.path->filename().string();
    } catch (...) {
      error = std::current_exception();
    }
  }
  const int64_t size = broadcast_i64(*group, error ? -1 : static_cast<int64_t>(name.size()));
  if (size < 0) {
    if (error) std::rethrow_exception(error);
    throw Relayed<CheckpointError>(
        0,
        fmt::format("[rank {}] looking for checkpoints in {}: rank 0 failed (its error says why)",
                    group->rank(), dir_.string()));
  }
  name = broadcast_bytes(*group, name, size);
  if (group->rank() != 0 && !name.empty()) out.path = dir_ / name;
  return out;
}

LoadedCheckpoint Checkpointer::load(const std::filesystem::path& file, TrainingState& state) const {
  return load(file, state, static_cast<ProcessGroup*>(nullptr));
}

LoadedCheckpoint Checkpointer::load(const std::filesystem::path& file, TrainingState& state,
                                    ProcessGroup& group) const {
  return load(file, state, &group);
}

LoadedCheckpoint Checkpointer::load(const std::filesystem::path& file, TrainingState& state,
                                    ProcessGroup* group) const {
  LoadOptions o;
  o.model_label = options_.model_label;
  if (!group) return load_checkpoint(file, state, o);
  o.rank = group->rank();
  o.world_size = group->size();
  LoadedCheckpoint out;
  std::exception_ptr error;
  try {
    out = load_checkpoint(file, state, o);
  } catch (...) {
    error = std::current_exception();
  }
  // Agree: if any rank could not load, no rank trains (it would train from another state).
  const auto flags = all_gather_i64(*group, error ? 1 : 0);
  if (error) std::rethrow_exception(error);
  std::vector<int> failed;
  for (int r = 0; r < group->size(); ++r) {
    if (flags[r]) failed.push_back(r);
  }
  if (!failed.empty()) {
    throw Relayed<CheckpointError>(
        failed.front(),
        fmt::format(
            "[rank {}] loading {} failed on rank(s) {} (their errors say why); every rank stops",
            group->rank(), file.string(), fmt::join(failed, ", ")));
  }
  return out;
}

}  // namespace ddp
