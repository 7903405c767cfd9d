// Sharded checkpoints: writing the rank files and metadata.ckpt, reading them back (Note
// [Sharded checkpoint] in sharded.h). The collective protocol is Checkpointer::save's.
#include "checkpoint/sharded.h"

#include <map>

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint/format.h"
#include "checkpoint/metadata.h"
#include "state/codec.h"
#include "state/shards.h"

namespace ddp::ckpt {
namespace {

using nlohmann::json;

// A file's metadata of format 2, or a CorruptCheckpointError naming the file.
FileMeta metadata_of(const CheckpointFile& f) {
  try {
    return decode_metadata(f.metadata());
  } catch (const std::exception& e) {
    f.corrupt(
        fmt::format("its metadata is not what this version of ddp-cpp writes ({})", e.what()));
  }
}

// metadata.ckpt, open and its metadata decoded, with the rank files it lists.
struct Manifest {
  explicit Manifest(const fs::path& dir) : file(open_metadata(dir)), fm(metadata_of(file)) {
    try {
      if (fm.files.is_null()) throw std::invalid_argument("it lists no rank files");
      for (const json& f : fm.files) {
        files.push_back({f.at("name").get<std::string>(), f.at("bytes").get<uint64_t>(),
                         f.at("sha256").get<std::string>()});
      }
    } catch (const std::exception& e) {
      file.corrupt(fmt::format("its list of rank files is malformed ({})", e.what()));
    }
    if (static_cast<int>(files.size()) != fm.meta.world_size) {
      file.corrupt(fmt::format("it lists {} rank files for a world of {}", files.size(),
                               fm.meta.world_size));
    }
    for (size_t r = 0; r < files.size(); ++r) {
      if (files[r].name != rank_file_name(static_cast<int>(r))) {
        file.corrupt(fmt::format("its rank file {} is named '{}'", r, files[r].name));
      }
    }
  }

  static CheckpointFile open_metadata(const fs::path& dir) {
    const fs::path path = dir / kShardedMetadataName;
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      throw CorruptCheckpointError(fmt::format(
          "{}: a sharded checkpoint without its {} (a save publishes the directory only once "
          "that file is written: this one was damaged since)",
          dir.string(), kShardedMetadataName));
    }
    return CheckpointFile(path);
  }

  CheckpointFile file;
  FileMeta fm;
  std::vector<RankFile> files;
};

// Rank r's file, opened (header and metadata checked) and compared with what metadata.ckpt
// recorded of it.
CheckpointFile open_rank_file(const fs::path& dir, const Manifest& m, int r) {
  const RankFile& want = m.files[static_cast<size_t>(r)];
  const fs::path path = dir / want.name;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw CorruptCheckpointError(fmt::format("{}: rank {}'s file is missing", path.string(), r));
  }
  CheckpointFile f(path);
  if (f.file_size() != want.bytes || hex(f.header_digest()) != want.sha256) {
    f.corrupt(fmt::format(
        "not the file this checkpoint's {} recorded ({} bytes, header checksum {}; it has {} "
        "bytes, header checksum {}): a rank file of another save",
        kShardedMetadataName, want.bytes, want.sha256.substr(0, 16), f.file_size(),
        hex(f.header_digest()).substr(0, 16)));
  }
  return f;
}

}  // namespace

std::string rank_file_name(int rank) { return fmt::format("rank-{:05d}.ckpt", rank); }

bool is_sharded(const fs::path& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

RankFile write_rank_file(const fs::path& temp_dir, int rank, const Snapshot& mine,
                         const CheckpointMeta& meta, const FaultHook& hook) {
  std::vector<Snapshot::Entry> entries;
  for (const Snapshot::Entry& e : mine.entries) {
    if (state::saved_by_each_rank(e.scope)) entries.push_back(e);
  }
  FileMeta fm;
  fm.meta = meta;
  for (const auto& e : entries) fm.meta.keys.push_back(e.key);
  const EncodedFile file = encode_file(entries, std::move(fm));
  RankFile out{rank_file_name(rank), file.size(), ""};
  Digest head{};  // the header's own checksum, which covers the payload's (Note [Checkpoint
                  // file format])
  std::copy(file.head.begin() + kHeaderHashedBytes, file.head.begin() + kHeaderBytes, head.begin());
  out.sha256 = hex(head);
  write_atomic(temp_dir / out.name, file.parts(), hook);
  return out;
}

void write_sharded_metadata(const fs::path& temp_dir, const Snapshot& mine,
                            const std::vector<std::string>& keys, const CheckpointMeta& meta,
                            const std::vector<RankFile>& files, const FaultHook& hook) {
  std::vector<Snapshot::Entry> entries;
  for (const Snapshot::Entry& e : mine.entries) {
    if (!state::saved_by_each_rank(e.scope)) entries.push_back(e);
  }
  FileMeta fm;
  fm.meta = meta;
  fm.meta.keys = keys;
  fm.files = json::array();
  for (const RankFile& f : files) {
    fm.files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  }
  write_atomic(temp_dir / kShardedMetadataName, encode_file(entries, std::move(fm)).parts(), hook);
}

CheckpointMeta read_sharded_meta(const fs::path& dir) { return Manifest(dir).fm.meta; }

void verify_sharded(const fs::path& dir) {
  const Manifest m(dir);
  m.file.verify_payload();
  for (int r = 0; r < static_cast<int>(m.files.size()); ++r) {
    open_rank_file(dir, m, r).verify_payload();
  }
}

LoadedCheckpoint load_sharded(const fs::path& dir, TrainingState& state,
                              const LoadOptions& options) {
  const Manifest m(dir);
  const int saved_world = m.fm.meta.world_size;
  Snapshot snapshot;
  snapshot.world_size = saved_world;
  {
    const std::string payload = m.file.read_payload();  // checked against its SHA-256
    snapshot.entries =
        state::decode(m.fm.states, payload, [&](const std::string& what) { m.file.corrupt(what); });
  }
  // Which rank's per-rank states this rank takes (as TrainingState::restore decides).
  const bool own = saved_world == options.world_size;
  const int per_rank_source = own ? options.rank : options.rank % saved_world;
  std::map<std::string, const Stateful*> objects;
  state.for_each([&](const std::string& key, Stateful& object) { objects[key] = &object; });
  std::map<std::string, size_t> entry_of;  // key -> its entry in `snapshot`
  for (int r = 0; r < saved_world; ++r) {
    const CheckpointFile f = open_rank_file(dir, m, r);
    const auto corrupt = [&](const std::string& what) { f.corrupt(what); };
    const FileMeta fm = metadata_of(f);
    // From the index alone (no payload read): does this file hold anything this rank loads?
    std::vector<Snapshot::Entry> entries = state::decode_index(fm.states, corrupt);
    bool needed = false;
    for (Snapshot::Entry& e : entries) {
      auto object = objects.find(e.key);
      if (object == objects.end() || e.ranks.size() != 1) continue;
      if (e.scope == StateScope::kPerRank) needed = needed || r == per_rank_source;
      if (e.scope != StateScope::kSharded) continue;
      StateDict& s = e.ranks[0];
      for (const auto& [name, piece] : state::pieces_of(s)) {
        const auto& [tensor, placement] = piece;
        if (!tensor->defined()) continue;
        const auto range = object->second->wanted(name, placement->whole_shape);
        needed = needed ||
                 (range && state::overlap(placement->offset, tensor->numel(), *range).numel > 0);
      }
      needed = needed || (r == 0 && s.tensors.size() > s.shards.size());  // rank 0's others
    }
    if (needed) {  // checked against its SHA-256; the tensors are views of it (no copy)
      auto payload = std::make_shared<std::string>(f.read_payload());
      entries = state::decode(fm.states, *payload, corrupt, payload);
    }
    // Not read: every tensor is on the meta device, and none is taken (a per-rank state of
    // another rank, pieces of other parts): they become empty below.
    for (Snapshot::Entry& e : entries) {
      if (!state::saved_by_each_rank(e.scope) || e.ranks.size() != 1) {
        f.corrupt(fmt::format("it holds state '{}' ({}), which a rank file does not", e.key,
                              to_string(e.scope)));
      }
      auto [it, fresh] = entry_of.emplace(e.key, snapshot.entries.size());
      if (fresh) {
        snapshot.entries.push_back({e.key, e.scope, {}});
        if (e.scope == StateScope::kPerRank) snapshot.entries.back().ranks.resize(saved_world);
      }
      Snapshot::Entry& into = snapshot.entries[it->second];
      StateDict& s = e.ranks[0];
      if (e.scope == StateScope::kPerRank) {
        if (needed && r == per_rank_source) into.ranks[static_cast<size_t>(r)] = std::move(s);
        continue;
      }
      // kSharded: keep only the elements this rank takes (pieces of other parts become empty,
      // their names and whole shapes kept for the object's check()).
      auto object = objects.find(e.key);
      for (const auto& [name, piece] : state::pieces_of(s)) {
        const auto& [tensor, placement] = piece;
        if (!tensor->defined()) continue;
        const auto range = object == objects.end()
                               ? std::nullopt
                               : object->second->wanted(name, placement->whole_shape);
        const state::Overlap o =
            range ? state::overlap(placement->offset, tensor->numel(), *range) : state::Overlap{};
        // A view of the payload: a file stays in memory while any part of it is taken.
        *tensor = o.numel == 0 ? at::empty({0}, at::TensorOptions().dtype(tensor->scalar_type()))
                               : tensor->reshape({-1}).narrow(0, o.from, o.numel);
        placement->offset = o.offset;
      }
      into.ranks.push_back(std::move(s));
    }
  }
  return restore_checkpoint(dir, m.fm.meta, snapshot, state, options);
}

}  // namespace ddp::ckpt
