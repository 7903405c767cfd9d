// ddp::Join (see include/ddp/join.h).
#include "ddp/join.h"

#include <cstdio>
#include <exception>

#include <fmt/format.h>

#include "base/check.h"
#include "base/log.h"
#include "parallel/ddp_core.h"

namespace ddp {

Join::Join(DistributedDataParallelBase& model, JoinOptions options) : core_(*model.core_) {
  options_holder_ = options;  // the core reads them through a pointer while attached
  core_.attach_join(&options_holder_);
}

Join::~Join() {
  if (!finished_ && std::uncaught_exceptions() == 0) {
    log::line(core_.process_group().rank(),
              "ddp::Join destroyed without finish(): the other ranks will wait for this one "
              "until their collective timeout. Call join.finish() after the loop.");
  }
  core_.attach_join(nullptr);
}

void Join::finish() {
  DDP_CHECK(!finished_, Error, "ddp::Join::finish() called twice");
  finished_ = true;
  const int world = core_.process_group().size();
  while (true) {
    const std::vector<int> active = core_.join_round(false);
    if (active.empty()) break;
    DDP_CHECK(!options_holder_.throw_on_early_termination, Error,
              "[rank {}] ddp::Join(throw_on_early_termination): this rank ran out of data while "
              "{} of {} ranks are still training",
              core_.process_group().rank(), active.size(), world);
    core_.shadow_iteration(active);
  }
  core_.sync_model_from(core_.last_active_rank());
  core_.attach_join(nullptr);
}

}  // namespace ddp
