// Sharded checkpoints: a directory in which each rank writes its own file
// (CheckpointerOptions::sharded in ddp/checkpoint.h).
//
// Note [Sharded checkpoint]
//   epoch=E-step=S.ckpt/     a directory where a one-file checkpoint has a file
//     metadata.ckpt          a checkpoint file (Note [Checkpoint file format]): the metadata
//                            (step, epoch, world size, every key), the replicated and collective
//                            states, and the rank files with each one's size and header checksum
//                            (which covers its metadata and its payload's SHA-256)
//     rank-00000.ckpt ...    rank r's per-rank and sharded states (its pieces: Note [Sharded
//                            states] in src/state/shards.h), a checkpoint file of its own
// Saving is a collective. Rank 0 makes a temporary directory beside the final name and tells
// the others its name; every rank writes its file into it (atomically, fsync'ed) and the ranks
// exchange the outcome with each file's size and digest; rank 0 then writes metadata.ckpt,
// fsyncs the directory and renames it into place (swapping out an older one of the same name),
// which publishes the whole checkpoint at once. A crash or a failure before that leaves only the
// temporary directory, which readers ignore and the next save removes; an older checkpoint is
// never touched. No rank holds more than its own states: a model that does not fit one process
// is saved by the processes it is sharded over. Every rank writes into the one directory, so the
// ranks need a shared file system (or one host); a rank that cannot reach it fails the save on
// every rank, with its error. last.ckpt is a symbolic link to the newest such directory.
//
// Loading: every rank reads metadata.ckpt and the index of every rank file (header and
// metadata: no payload), checking each file against the size and digest metadata.ckpt recorded
// (a rank file of another save counts as damage). It then reads the payloads that hold what it
// loads, each checked against its SHA-256 before use: its per-rank states' file (its own at the
// same world size, rank r % W's at another) and the files whose pieces overlap its part of a
// sharded tensor now. At the same world size a rank reads metadata.ckpt and its own file; at
// another, the few files its new part spans. Verification (latest_valid) reads every file.
//
// How far from PyTorch's torch.distributed.checkpoint (DCP): the same shape (a directory of a
// metadata file and one file per rank: DCP's .metadata and __<rank>_0.distcp), but our own
// encoding (DCP pickles its metadata and writes torch.save's bytes) and flat pieces where DCP
// records N-dimensional chunks: neither reads the other's files. What PyTorch loads is
// ddp-train's final model_state.pt, written whole, one unit at a time.
#pragma once

#include <filesystem>
#include <string>

#include "checkpoint/file_io.h"
#include "ddp/checkpoint.h"

namespace ddp::ckpt {

inline constexpr const char* kShardedMetadataName = "metadata.ckpt";

// "rank-00003.ckpt"
std::string rank_file_name(int rank);

// Whether `path` is a sharded checkpoint (a directory, or a link to one).
bool is_sharded(const fs::path& path);

// A rank's file as saved: its name in the directory, its size and its header checksum (hex: the
// SHA-256 over the header's fields, its payload's SHA-256 among them, and its metadata).
struct RankFile {
  std::string name;
  uint64_t bytes = 0;
  std::string sha256;
};

// Writes this rank's states (rank_snapshot: its per-rank and sharded entries; the others are
// skipped) as `temp_dir`/rank_file_name(rank), atomically. Throws CheckpointError.
RankFile write_rank_file(const fs::path& temp_dir, int rank, const Snapshot& mine,
                         const CheckpointMeta& meta, const FaultHook& hook);

// Writes `temp_dir`/metadata.ckpt: `meta` with every key of `keys`, the replicated and collective
// entries of rank 0's `mine`, and `files`. Throws CheckpointError.
void write_sharded_metadata(const fs::path& temp_dir, const Snapshot& mine,
                            const std::vector<std::string>& keys, const CheckpointMeta& meta,
                            const std::vector<RankFile>& files, const FaultHook& hook);

// read_checkpoint_meta, verify_checkpoint and load_checkpoint of a sharded checkpoint.
CheckpointMeta read_sharded_meta(const fs::path& dir);
void verify_sharded(const fs::path& dir);
LoadedCheckpoint load_sharded(const fs::path& dir, TrainingState& state,
                              const LoadOptions& options);

}  // namespace ddp::ckpt
