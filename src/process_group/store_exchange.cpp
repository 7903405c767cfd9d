// Note [Store exchange] in store_exchange.h.
#include "process_group/store_exchange.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

namespace ddp::store_exchange {

std::vector<uint8_t> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }
std::string text_of(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

std::vector<std::string> exchange(::c10d::Store& store, const std::string& key, int rank, int size,
                                  const std::string& mine, Linger linger) {
  std::vector<std::string> all(size);
  all[rank] = mine;
  if (size == 1) return all;
  store.set(fmt::format("{}/{}", key, rank), bytes_of(mine));
  for (int r = 0; r < size; ++r) {
    if (r != rank) all[r] = text_of(store.get(fmt::format("{}/{}", key, r)));
  }
  if (linger == Linger::kNo) return all;
  if (store.add(key + "/read", 1) == size) store.set(key + "/all_read", bytes_of("1"));
  store.get(key + "/all_read");
  store.add(key + "/done", 1);
  if (rank == 0) {
    const auto until = std::chrono::steady_clock::now() +
                       std::min<std::chrono::milliseconds>(kLingerLimit, store.getTimeout());
    while (store.add(key + "/done", 0) < size && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return all;
}

}  // namespace ddp::store_exchange
