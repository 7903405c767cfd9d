// The agent store as the rounds' key-value store (key_value.h).
#include "key_value.h"

#include <thread>

namespace ddp::launcher {

void KeyValue::wait_for_change(const std::string& /*prefix*/, const std::string& /*quiet*/,
                               std::chrono::milliseconds timeout) {
  std::this_thread::sleep_for(timeout);
}

namespace {

class AgentStore final : public KeyValue {
 public:
  explicit AgentStore(const store::ClientOptions& options) : client_(options) {}

  void set(const std::string& key, std::string_view value, Deadline deadline) override {
    client_.set(key, value, deadline);
  }
  std::string get(const std::string& key, std::chrono::milliseconds wait,
                  Deadline deadline) override {
    return client_.get(key, wait, deadline);
  }
  int64_t add(const std::string& key, int64_t delta, Deadline deadline) override {
    return client_.add(key, delta, deadline);
  }
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired, Deadline deadline) override {
    return client_.compare_set(key, expected, desired, deadline);
  }
  bool check(const std::string& key, Deadline deadline) override {
    return client_.check({key}, deadline);
  }
  void beat(const std::string& key, Deadline deadline) override { client_.add(key, 1, deadline); }
  int64_t count_beats(const std::string& key, Deadline deadline) override {
    return client_.add(key, 0, deadline);
  }
  std::string describe() const override { return client_.endpoint(); }

 private:
  store::Client client_;
};

}  // namespace

std::unique_ptr<KeyValue> agent_store_key_value(const store::ClientOptions& options) {
  return std::make_unique<AgentStore>(options);
}

}  // namespace ddp::launcher
