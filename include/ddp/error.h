// Errors thrown by ddp-cpp.
//
// Every failure a user can cause or meet (a bad environment, a rank that never joined, a
// collective that timed out) is thrown as a subclass of ddp::Error whose message names the rank,
// the operation and the remedy. The library never calls exit(); only a tool's main() turns an
// error into an exit code. InternalError means a bug in ddp-cpp itself.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ddp {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The environment, options or command line are wrong; nothing was started.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Ranks could not form a group: missing ranks, unreachable store, port in use, mismatched ranks.
class RendezvousError : public Error {
 public:
  using Error::Error;
};

// A collective failed (a peer crashed, the connection broke, inputs differ between ranks).
class CollectiveError : public Error {
 public:
  using Error::Error;
};

// A collective did not complete within the group's timeout.
class TimeoutError : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

// Input data is missing, truncated or malformed (a dataset file, a sample index out of range,
// a loader worker that failed); the message names the file or batch and what was wrong.
class DataError : public Error {
 public:
  using Error::Error;
};

// An invariant of ddp-cpp itself was broken: a bug to report, not a usage error.
class InternalError : public Error {
 public:
  using Error::Error;
};

// Records why this worker is failing in the file named by TORCHELASTIC_ERROR_FILE (set by
// ddprun and torchrun), in torchrun's format plus a microsecond timestamp:
//   {"message": {"message": "...", "extraInfo": {"py_callstack": "",
//                "timestamp": "<unix s>", "timestamp_us": "<unix us>"}}}
// The launcher reports the earliest recorded failure as the root cause, so a rank that fails
// because a peer died is not mistaken for the culprit. No-op when the variable is unset;
// never throws. Call it from main() where an error becomes an exit code.
void record_error(std::string_view message);

// Whether `e` says an allocation failed: std::bad_alloc, or LibTorch's allocators (the CPU's
// "DefaultCPUAllocator: can't allocate memory" or "not enough memory", CUDA's "out of memory").
bool is_out_of_memory(const std::exception& e);
// For such an error: "out of memory: <the allocator's first line>", then what holds the memory
// and what to do (a DistributedDataParallel replica holds the whole model, its gradients and the
// optimizer's state on every rank; FullyShardedDataParallel keeps 1/world of each). The uncaught
// handler below and ddp-train print it.
std::string out_of_memory_text(const std::exception& e);

// torchrun's @record for C++: an exception that escapes main() (or any thread) is printed once,
// "[rank R]: error: uncaught ddp::CollectiveError: <what>", written to the error file as
// record_error() does, and the process exits with status 1 instead of the runtime's abort (no
// core dump, no second copy of the message). init_process_group() installs it (one of its
// process defaults: InitOptions::process_defaults); a program that never calls it can with this
// one line. `rank` < 0: RANK from the
// environment, if any. Installs nothing, returning false, when the program has a terminate
// handler of its own (that handler wins; one set later replaces this one).
bool record_uncaught_errors(int rank = -1);

}  // namespace ddp
