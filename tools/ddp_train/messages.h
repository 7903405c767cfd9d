// How ddp-train words what it prints about itself (errors, preemption).
//
// Note [One rank prefix]
// ddp-train's lines carry no rank prefix of their own: the launcher adds it (ddprun prefixes
// every worker line with "[rank N]: "; torchrun --tee / --log-line-prefix-template, mpirun
// --tag-output and srun --label do the same on request), and a launcher's failure summary names
// the rank beside the recorded error. Library errors open with "[rank N] " for programs that
// print them raw; error_text() drops that opening when N is this process's rank. An error about
// another rank (one relayed to this one) keeps its "[rank K]", which names where it came from.
#pragma once

#include <string>
#include <string_view>

namespace ddp::train {

// `what` without a leading "[rank <rank>] " (see the Note).
std::string error_text(std::string_view what, int rank);

}  // namespace ddp::train
