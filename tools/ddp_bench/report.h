// What ddp-bench writes: table lines (rank 0's stdout), CSV files and gnuplot PNGs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::bench {

// One size of one collective on one backend (nccl-tests' columns), or the memcpy floor
// (backend and op "memcpy").
struct CollectiveRow {
  std::string backend, op, dtype;
  int ranks = 1;
  int64_t bytes = 0;  // the whole buffer: all_gather's output, reduce_scatter's input
  int64_t count = 0;  // elements in those bytes
  int iters = 0;
  double time_us = 0;     // median over iterations of the mean over ranks
  double algbw_gbps = 0;  // bytes / time, 1e9 bytes per GB as in nccl-tests
  double busbw_gbps = 0;  // algbw x bus_factor(op, ranks)
  int64_t wrong = 0;      // iterations whose result differed from the expected one, all ranks
};

std::string collective_table_header();
std::string collective_table_line(const CollectiveRow& row);
// Writes (replaces) `path`. Throws ddp::Error when it cannot.
void write_collectives_csv(const std::string& path, const std::vector<CollectiveRow>& rows);
// busbw (algbw at world size 1, where busbw is 0) against size, log2 x axis, one line per
// backend + op (+ dtype when several), the memcpy floor as a horizontal line. Returns a note.
std::string plot_collectives(const std::string& png, const std::vector<CollectiveRow>& rows);

// One measured training configuration: throughput and where a step's time goes (ms per step;
// means over the timed steps, averaged over ranks).
struct TrainRow {
  std::string label;  // e.g. "2 ranks x 1 thread"
  std::string model, backend;
  int world_size = 1, threads = 1;
  int64_t global_batch = 0;
  int steps = 0;
  double samples_per_s = 0;
  double step_ms = 0;
  double data_ms = 0, forward_ms = 0, backward_ms = 0, comm_ms = 0, optimizer_ms = 0;
};

std::string train_table_header();
std::string train_table_line(const TrainRow& row);
// Appends to `path`, writing the header first when the file is new or empty.
void append_train_csv(const std::string& path, const std::vector<TrainRow>& rows);
// Stacked bars: ms per step by component, one bar per row, samples/s in the labels.
std::string plot_train(const std::string& png, const std::vector<TrainRow>& rows);

}  // namespace ddp::bench
