// c10d::Store adapters over our store and around stores we do not control (see c10d_store.h).
#include "store/c10d_store.h"

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::store {
namespace {

using std::chrono::milliseconds;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }
std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string quoted(const std::string& key) { return fmt::format("\"{}\"", printable(key, 120)); }
std::string quoted(const std::vector<std::string>& keys) {
  if (keys.empty()) return "";
  return quoted(keys.front()) +
         (keys.size() > 1 ? fmt::format(" and {} more", keys.size() - 1) : "");
}

milliseconds bounded(milliseconds timeout) {
  return timeout == ::c10d::Store::kNoTimeout
             ? std::chrono::duration_cast<milliseconds>(::c10d::Store::kDefaultTimeout)
             : timeout;
}

}  // namespace

milliseconds answer_grace(milliseconds wait) {
  return std::clamp(wait / 4, milliseconds(250), milliseconds(5000));
}

// ---------------------------------------------------------------------------------------------
// DdpStore

DdpStore::DdpStore(ClientOptions options, milliseconds timeout, std::shared_ptr<Server> server)
    : StoreBase(timeout), server_(std::move(server)),
      client_(std::make_unique<Client>(std::move(options))) {}

milliseconds DdpStore::bound() const { return bounded(timeout_); }

void DdpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  client_->set(key, {reinterpret_cast<const char*>(value.data()), value.size()},
               Clock::now() + bound());
}

std::vector<uint8_t> DdpStore::compareSet(const std::string& key,
                                          const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  return bytes(client_->compare_set(key, text(expected), text(desired), Clock::now() + bound()));
}

std::vector<uint8_t> DdpStore::get(const std::string& key) {
  const milliseconds wait = bound();
  return bytes(client_->get(key, wait, Clock::now() + wait + answer_grace(wait)));
}

int64_t DdpStore::add(const std::string& key, int64_t value) {
  return client_->add(key, value, Clock::now() + bound());
}

bool DdpStore::deleteKey(const std::string& key) {
  return client_->remove(key, Clock::now() + bound());
}

bool DdpStore::check(const std::vector<std::string>& keys) {
  return client_->check(keys, Clock::now() + bound());
}

int64_t DdpStore::getNumKeys() { return client_->num_keys(Clock::now() + bound()); }

void DdpStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void DdpStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  const milliseconds wait = bounded(timeout);
  client_->wait(keys, wait, Clock::now() + wait + answer_grace(wait));
}

c10::intrusive_ptr<::c10d::Store> DdpStore::clone_store() {
  return c10::make_intrusive<DdpStore>(client_->options(), timeout_, server_);
}

// ---------------------------------------------------------------------------------------------
// BoundedStore

struct BoundedStore::Worker {
  Mutex mu;
  CondVar cv{&mu};  // a task was posted or done, or stop
  std::function<void()> task GUARDED_BY(mu);
  uint64_t posted GUARDED_BY(mu) = 0;
  uint64_t done GUARDED_BY(mu) = 0;
  std::exception_ptr error GUARDED_BY(mu);  // the last task's
  bool stop GUARDED_BY(mu) = false;
  c10::intrusive_ptr<::c10d::Store> inner;  // used by the worker thread only

  void loop() EXCLUDES(mu) {
    mu.lock();
    while (true) {
      while (!stop && posted <= done) cv.wait();
      if (posted == done) break;  // stop, and no call waits
      std::function<void()> t = std::move(task);
      mu.unlock();
      std::exception_ptr e;
      try {
        t();
      } catch (...) {
        e = std::current_exception();
      }
      mu.lock();
      error = e;
      ++done;
      cv.signal_all();
      if (stop) break;
    }
    mu.unlock();
  }
};

BoundedStore::BoundedStore(std::function<c10::intrusive_ptr<::c10d::Store>()> make,
                           milliseconds timeout, std::string who, std::string endpoint,
                           std::string owner)
    : StoreBase(timeout), make_(std::move(make)), who_(std::move(who)),
      endpoint_(std::move(endpoint)), owner_(std::move(owner)),
      worker_(std::make_shared<Worker>()) {
  thread_ = std::thread([w = worker_] { w->loop(); });
  // The first task builds the inner store (a TCPStore client connects, and from 2.x
  // validates, in its constructor); its own errors reach the caller unchanged.
  const milliseconds limit = bound() + answer_grace(bound());
  try {
    run("connecting", limit, [w = worker_, make = make_] { w->inner = make(); });
  } catch (...) {
    shutdown();  // the destructor does not run for a constructor that throws
    throw;
  }
}

BoundedStore::~BoundedStore() { shutdown(); }

void BoundedStore::shutdown() {
  if (!thread_.joinable()) return;
  {
    MutexLock lock(&worker_->mu);
    worker_->stop = true;
    worker_->cv.signal_all();
  }
  // A call still stuck inside the inner store cannot be interrupted: its thread is left to
  // finish (or to die with the process); it owns what it uses through `worker_`. No call runs
  // now (the store is being destroyed, or its constructor failed): call_mu_ is free.
  bool stuck = false;
  {
    TimedMutexLock call(&call_mu_);
    stuck = !broken_.empty();
  }
  if (!stuck)
    thread_.join();
  else
    thread_.detach();
}

milliseconds BoundedStore::bound() const { return bounded(timeout_); }

void BoundedStore::run(const std::string& what, milliseconds limit, std::function<void()> task) {
  const auto started = Clock::now();
  const auto deadline = started + limit;
  if (!call_mu_.try_lock_until(deadline)) {
    throw RendezvousError(
        fmt::format("{} {} on the rendezvous store at {} waited {:.1f} s for another thread's call",
                    who_, what, endpoint_, seconds(Clock::now() - started)));
  }
  TimedMutexLock call(&call_mu_, std::adopt_lock);
  if (!broken_.empty()) throw RendezvousError(broken_);
  std::exception_ptr error;
  {
    Worker& w = *worker_;
    MutexLock lock(&w.mu);
    w.task = std::move(task);
    const uint64_t mine = ++w.posted;
    w.cv.signal_all();
    while (w.done < mine) {
      if (w.cv.wait_until(deadline) == std::cv_status::timeout && w.done < mine) {
        broken_ = fmt::format(
            "{} the rendezvous store at {} did not answer {} within {:.1f} s: the process "
            "hosting it ({}) is stopped (SIGSTOP, a debugger), frozen or overloaded, or {} "
            "belongs to another program than this job's store",
            who_, endpoint_, what, seconds(Clock::now() - started), owner_, endpoint_);
        throw RendezvousError(broken_);
      }
    }
    error = std::exchange(w.error, nullptr);
  }
  if (!error) return;
  if (what == "connecting") std::rethrow_exception(error);
  try {
    std::rethrow_exception(error);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw RendezvousError(fmt::format("{} {} on the rendezvous store at {} ({}) failed: {}", who_,
                                      what, endpoint_, owner_, e.what()));
  }
}

void BoundedStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  run(fmt::format("set({})", quoted(key)), bound(),
      [w = worker_, key, value] { w->inner->set(key, value); });
}

std::vector<uint8_t> BoundedStore::compareSet(const std::string& key,
                                              const std::vector<uint8_t>& expected,
                                              const std::vector<uint8_t>& desired) {
  auto out = std::make_shared<std::vector<uint8_t>>();
  run(fmt::format("compareSet({})", quoted(key)), bound(),
      [w = worker_, out, key, expected, desired] {
        *out = w->inner->compareSet(key, expected, desired);
      });
  return *out;
}

std::vector<uint8_t> BoundedStore::get(const std::string& key) {
  auto out = std::make_shared<std::vector<uint8_t>>();
  const milliseconds wait = bound();
  run(fmt::format("get({})", quoted(key)), wait + answer_grace(wait),
      [w = worker_, out, key, wait] {
        w->inner->setTimeout(wait);
        *out = w->inner->get(key);
      });
  return *out;
}

int64_t BoundedStore::add(const std::string& key, int64_t value) {
  auto out = std::make_shared<int64_t>(0);
  run(fmt::format("add({}, {})", quoted(key), value), bound(),
      [w = worker_, out, key, value] { *out = w->inner->add(key, value); });
  return *out;
}

bool BoundedStore::deleteKey(const std::string& key) {
  auto out = std::make_shared<bool>(false);
  run(fmt::format("deleteKey({})", quoted(key)), bound(),
      [w = worker_, out, key] { *out = w->inner->deleteKey(key); });
  return *out;
}

bool BoundedStore::check(const std::vector<std::string>& keys) {
  auto out = std::make_shared<bool>(false);
  run(fmt::format("check({})", quoted(keys)), bound(),
      [w = worker_, out, keys] { *out = w->inner->check(keys); });
  return *out;
}

int64_t BoundedStore::getNumKeys() {
  auto out = std::make_shared<int64_t>(0);
  run("getNumKeys()", bound(), [w = worker_, out] { *out = w->inner->getNumKeys(); });
  return *out;
}

void BoundedStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void BoundedStore::wait(const std::vector<std::string>& keys, const milliseconds& timeout) {
  const milliseconds wait = bounded(timeout);
  run(fmt::format("wait({})", quoted(keys)), wait + answer_grace(wait),
      [w = worker_, keys, wait] { w->inner->wait(keys, wait); });
}

c10::intrusive_ptr<::c10d::Store> BoundedStore::clone_store() {
  return c10::make_intrusive<BoundedStore>(make_, timeout_, who_, endpoint_, owner_);
}

}  // namespace ddp::store
