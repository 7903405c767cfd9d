// The wire protocol of ddp-cpp's rendezvous store: frames, requests, the handshake. Torch-free.
//
// Note [Store protocol]
// Everything on the wire is a frame: a 4-byte little-endian length, then that many bytes of
// body. A length above the limit of the connection's state is a protocol violation: the
// connection is closed without reading (let alone allocating) the body.
//
//   1. Greeting (server -> client, right after accept):
//        "DDPSTORE" | version u8 | server nonce (16 random bytes)
//   2. Hello (client -> server, at most kMaxHelloBytes):
//        "DDPSTORE" | version u8 | client nonce (16) | client proof (32) | identity (bytes)
//      client proof = HMAC-SHA256(job key, "ddp-store client v1" | server nonce | client nonce)
//   3. Welcome (server -> client): status | server proof (32), where
//      server proof = HMAC-SHA256(job key, "ddp-store server v1" | client nonce | server nonce)
//      or status kError and why (wrong secret, version), then the server closes.
//   4. Requests, one at a time: op u8 | fields; each gets one response: status u8 | payload.
// Both sides prove that they hold the job key without sending it: a stranger cannot join or
// write keys, and a rank cannot be captured by another job's store on the same port (it checks
// the server's proof). Fresh nonces on both sides make a recorded session useless to replay.
// The job key is DDP_STORE_SECRET when the launcher gives one, else derived from the run id
// (job_key()): that keeps other jobs out by accident, not an attacker who learns the run id.
//
// Fields: bytes = u32 length | data; int = i64 little-endian; keys of a list = u32 count |
// bytes... . Requests (the semantics of c10d::Store, which the client exposes):
//   kSet key value -> -                 kGet wait_ms key -> value (waits for the key)
//   kAdd key delta -> new value         kCompareSet key expected desired -> value (c10d's rule)
//   kCheck keys -> u8 all exist         kWait wait_ms keys -> - (waits for every key)
//   kDelete key -> u8 existed           kNumKeys -> count
// A wait the server cannot satisfy within wait_ms gets status kTimeout and the missing keys.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ddp::store {

inline constexpr std::string_view kMagic = "DDPSTORE";
inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kNonceBytes = 16;
inline constexpr size_t kProofBytes = 32;  // HMAC-SHA256
inline constexpr size_t kFrameHeaderBytes = 4;

// What a peer may send before it has proved it holds the job key: the hello and nothing else.
inline constexpr size_t kMaxIdentityBytes = 256;
inline constexpr size_t kMaxHelloBytes =
    kMagic.size() + 1 + kNonceBytes + kProofBytes + 4 + kMaxIdentityBytes;

// Note [Store limits]
// Every allocation the store makes is bounded by a limit, checked before the allocation:
// a frame's length before its body is read, a value before it is stored, the whole store's
// contents before a key grows it. The defaults are far above what ranks use (Gloo and the
// shared-memory transport write keys of ~100 bytes and values of ~100 bytes to a few KiB)
// and far below what would hurt rank 0 (a 1 GiB length prefix is refused unread).
struct Limits {
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = size_t{16} << 20;  // 16 MiB
  size_t max_keys_per_request = 4096;         // check/wait lists
  // The largest request or response body that can respect the limits above (a compareSet
  // carries a key and two values; a key list must fit in it too).
  size_t max_frame_bytes() const { return 64 + 2 * max_key_bytes + 2 * max_value_bytes; }
};

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kCheck = 5,
  kWait = 6,
  kDelete = 7,
  kNumKeys = 8,
};
const char* to_string(Op op);

enum class Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

// A malformed frame body (the peer is not speaking this protocol, or is broken).
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Appends fields to a frame; frame() prepends the length.
class Writer {
 public:
  Writer& u8(uint8_t v);
  Writer& i64(int64_t v);
  Writer& u32(uint32_t v);
  Writer& raw(std::string_view bytes);
  Writer& bytes(std::string_view b);  // u32 length | data
  Writer& keys(const std::vector<std::string>& keys);
  const std::string& body() const { return body_; }
  std::string frame() const;  // 4-byte length | body

 private:
  std::string body_;
};

// Reads fields of one frame body; every read is bounds-checked (ProtocolError).
class Reader {
 public:
  explicit Reader(std::string_view body) : rest_(body) {}
  uint8_t u8();
  uint32_t u32();
  int64_t i64();
  std::string_view raw(size_t n);
  std::string_view bytes(size_t max);  // fails above `max` bytes
  std::vector<std::string> keys(size_t max_count, size_t max_key);
  bool done() const { return rest_.empty(); }
  void expect_done() const;

 private:
  std::string_view rest_;
};

// The length announced by a frame header (the first 4 bytes of `header`).
uint32_t frame_length(std::string_view header);

// The key both sides prove they hold: the secret when there is one, else the run id.
std::string job_key(std::string_view secret, std::string_view run_id);

using Nonce = std::array<unsigned char, kNonceBytes>;
using Proof = std::array<unsigned char, kProofBytes>;
Nonce random_nonce();
Proof client_proof(std::string_view key, const Nonce& server_nonce, const Nonce& client_nonce);
Proof server_proof(std::string_view key, const Nonce& client_nonce, const Nonce& server_nonce);
bool proofs_equal(std::string_view a, const Proof& b);  // constant time

std::string greeting(const Nonce& server_nonce);  // a whole frame
// The server nonce of a greeting body; nullopt when it is not one.
std::optional<Nonce> parse_greeting(std::string_view body);

struct Hello {
  Nonce nonce;
  std::string proof;
  std::string identity;
};
std::string hello(const Nonce& client_nonce, const Proof& proof, std::string_view identity);
Hello parse_hello(std::string_view body);  // ProtocolError when malformed; checks the magic

// `bytes` for a log line: printable ASCII kept, the rest escaped (\r, \n, \xNN), at most `max`
// input bytes shown.
std::string printable(std::string_view bytes, size_t max = 48);

}  // namespace ddp::store
