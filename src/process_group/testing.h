// What tests may ask of a group beyond InitOptions: N ranks as N threads of one process, laid out
// as several hosts (tests/support/ranks.h, DDP_TEST_HOSTS). Internal: the public headers do not
// show it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "ddp/process_group.h"

namespace ddp {
namespace detail {

struct TestingOptions : InitOptions {
  // Which ranks count as one host (may share memory). Unset: the kernel's view (hostname, boot
  // id, pid namespace, user), compared through the store. Ranks that set equal ids must really
  // share a kernel and pid namespace: threads of one process do.
  std::optional<std::string> host_id;
};

}  // namespace detail

// make_process_group with the testing options (found before the public overload for them).
std::shared_ptr<ProcessGroup> make_process_group(const detail::TestingOptions& options);

}  // namespace ddp
