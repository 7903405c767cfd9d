// kSharded states (ddp/stateful.h): joining every rank's pieces into whole tensors, and
// assembling the elements a rank asks for from saved pieces, at any world size.
//
// Note [Sharded states]
// A kSharded state is, on each rank, pieces of whole tensors: a tensor named in
// StateDict::shards holds elements [offset, offset + numel) of the whole tensor of that name,
// in row-major order (FullyShardedDataParallel's flat shards cut at each parameter's bounds, as
// FSDP1's use_orig_params shows them). The pieces of one name on all ranks must agree on the
// whole shape and the dtype; together they cover the whole tensor (overlaps hold the same
// values). Saving keeps the pieces as they are (a sharded checkpoint: each rank's file holds its
// own) or joins them into whole tensors (a collective snapshot, a one-file checkpoint: a whole
// tensor is a piece at offset 0). Loading asks the object, per saved name, which elements this
// rank needs now (Stateful::wanted: its part at the new world size) and copies them out of
// whichever pieces hold them; a range not covered is an incompatible state, never zeros. So a
// state saved at world size W loads at any W', from whole tensors or from W ranks' pieces alike,
// and a state saved whole under another scope (FullyShardedDataParallel's checkpoints before
// kSharded: kCollective, whole parameters) loads the same way. PyTorch's
// torch.distributed.checkpoint plans loads the same way (each rank reads the overlap of the
// saved chunks with its own); its chunks are N-dimensional boxes, ours flat ranges.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ddp/stateful.h"
#include "ddp/training_state.h"

namespace ddp {
class ProcessGroup;
}

namespace ddp::state {

// This rank's part of a sharded checkpoint (a collective: every rank, at the same point): its
// kPerRank and kSharded states, and on rank 0 the replicated and collective ones (every rank
// calls the collective ones' state_dict()). Throws the ConfigError of snapshot(group) when the
// ranks registered different states. Entries hold one StateDict, this rank's.
Snapshot rank_snapshot(TrainingState& state, ProcessGroup& group);

// The pieces of `ranks` (each rank's StateDict of a kSharded state `key`) joined: one StateDict
// holding every whole tensor (placed at offset 0), rank 0's other tensors and JSON. Throws
// ConfigError naming `key` and the tensor when pieces disagree or leave a gap: a Stateful that
// does not keep the contract.
StateDict join_pieces(const std::string& key, const std::vector<StateDict>& ranks);

// What `object` loads on this rank (see Stateful::wanted) from `saved`: the states saved on
// each rank (one when they were joined), `pieces` false when they were saved under another scope
// (then each tensor is a whole one). Fills `out` and returns "", or returns why the saved pieces
// cannot give what is wanted (shapes or dtypes that disagree, elements no piece holds).
std::string assemble(const Stateful& object, const std::vector<StateDict>& saved, bool pieces,
                     StateDict& out);

// Whether every rank's state_dict() of this scope is saved (kPerRank, kSharded), not rank 0's.
inline bool saved_by_each_rank(StateScope scope) {
  return scope == StateScope::kPerRank || scope == StateScope::kSharded;
}

// The pieces of `s` by name: each placed tensor with its placement (the codec checks that every
// placed name is a tensor).
std::map<std::string, std::pair<at::Tensor*, ShardPlacement*>> pieces_of(StateDict& s);

// Where the elements of a piece (piece_offset, piece_numel in its whole tensor) meet `wanted`:
// their first element in the whole tensor, their count (0 when they do not meet), and where in
// the piece they start.
struct Overlap {
  int64_t offset = 0;  // in the whole tensor
  int64_t numel = 0;
  int64_t from = 0;  // the first element of the piece it starts at
};
Overlap overlap(int64_t piece_offset, int64_t piece_numel, const ElementRange& wanted);

int64_t numel_of(const std::vector<int64_t>& shape);

}  // namespace ddp::state
