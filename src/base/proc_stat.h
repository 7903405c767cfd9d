// What /proc/<pid>/stat says about a process of this host: its state and when it started.
// Torch-free; read by the shared-memory transport (a peer that died or was stopped) and the
// hang reporter (a local peer that did not answer).
//
// A pid alone does not name a process: once it exits, the kernel may hand its pid to another.
// The pid with its start time does, for as long as the host runs, so each rank publishes both
// and a peer compares them before it calls a rank running.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ddp {

struct ProcStat {
  char state = '?';         // field 3: R, S, D, T or t (stopped), Z (zombie), X or x (dead)...
  uint64_t start_time = 0;  // field 22: clock ticks after boot

  bool stopped() const { return state == 'T' || state == 't'; }
  bool dead() const { return state == 'Z' || state == 'X' || state == 'x'; }
};

// One line of /proc/<pid>/stat; nullopt when it is malformed. The command name (field 2, in
// parentheses) may contain spaces and ')': the fields are counted after its last ')'.
std::optional<ProcStat> parse_proc_stat(std::string_view line);

// /proc/<pid>/stat of this host; nullopt when there is no such process (or it is unreadable).
std::optional<ProcStat> read_proc_stat(int pid);

// The process `pid` that started at `start_time` (0: unknown, any start time), when it is
// alive: nullopt when the pid has no process, a zombie, or one that started at another time
// (the pid was reused).
std::optional<ProcStat> live_process(int pid, uint64_t start_time);

// This process's start time (field 22 of /proc/self/stat); 0 when it cannot be read.
uint64_t own_start_time();

}  // namespace ddp
