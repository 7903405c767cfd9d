// The store's wire format and handshake (Note [Store protocol] in protocol.h).
#include "store/protocol.h"

#include <sys/random.h>  // getrandom

#include <cerrno>
#include <cstring>

#include <fmt/format.h>
#include <openssl/crypto.h>  // CRYPTO_memcmp
#include <openssl/evp.h>     // EVP_sha256
#include <openssl/hmac.h>    // HMAC (the one-shot function)

#include "base/check.h"

namespace ddp::store {
namespace {

constexpr std::string_view kClientLabel = "ddp-store client v1";
constexpr std::string_view kServerLabel = "ddp-store server v1";

Proof hmac(std::string_view key, std::string_view label, const Nonce& a, const Nonce& b) {
  std::string message(label);
  message.append(reinterpret_cast<const char*>(a.data()), a.size());
  message.append(reinterpret_cast<const char*>(b.data()), b.size());
  Proof out{};
  unsigned int len = 0;
  const unsigned char* ok = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                 reinterpret_cast<const unsigned char*>(message.data()),
                                 message.size(), out.data(), &len);
  DDP_ASSERT(ok != nullptr && len == out.size(), "HMAC-SHA256 failed");
  return out;
}

std::string_view view(const Proof& p) {
  return {reinterpret_cast<const char*>(p.data()), p.size()};
}

}  // namespace

const char* to_string(Op op) {
  switch (op) {
    case Op::kSet: return "set";
    case Op::kGet: return "get";
    case Op::kAdd: return "add";
    case Op::kCompareSet: return "compareSet";
    case Op::kCheck: return "check";
    case Op::kWait: return "wait";
    case Op::kDelete: return "deleteKey";
    case Op::kNumKeys: return "getNumKeys";
  }
  return "?";
}

Writer& Writer::u8(uint8_t v) {
  body_.push_back(static_cast<char>(v));
  return *this;
}

Writer& Writer::u32(uint32_t v) {
  for (int i = 0; i < 4; ++i) body_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return *this;
}

Writer& Writer::i64(int64_t v) {
  const auto u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) body_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
  return *this;
}

Writer& Writer::raw(std::string_view bytes) {
  body_.append(bytes);
  return *this;
}

Writer& Writer::bytes(std::string_view b) {
  DDP_ASSERT(b.size() <= UINT32_MAX, "field of {} bytes", b.size());
  u32(static_cast<uint32_t>(b.size()));
  return raw(b);
}

Writer& Writer::keys(const std::vector<std::string>& keys) {
  u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) bytes(k);
  return *this;
}

std::string Writer::frame() const {
  Writer head;
  head.u32(static_cast<uint32_t>(body_.size()));
  return head.body_ + body_;
}

std::string_view Reader::raw(size_t n) {
  if (rest_.size() < n) {
    throw ProtocolError(
        fmt::format("frame ends early: {} more bytes expected, {} left", n, rest_.size()));
  }
  std::string_view out = rest_.substr(0, n);
  rest_.remove_prefix(n);
  return out;
}

uint8_t Reader::u8() { return static_cast<uint8_t>(raw(1)[0]); }

uint32_t Reader::u32() { return frame_length(raw(4)); }

int64_t Reader::i64() {
  std::string_view b = raw(8);
  uint64_t u = 0;
  for (int i = 7; i >= 0; --i) u = (u << 8) | static_cast<unsigned char>(b[i]);
  return static_cast<int64_t>(u);
}

std::string_view Reader::bytes(size_t max) {
  const uint32_t n = u32();
  if (n > max) throw ProtocolError(fmt::format("field of {} bytes (limit {})", n, max));
  return raw(n);
}

std::vector<std::string> Reader::keys(size_t max_count, size_t max_key) {
  const uint32_t n = u32();
  if (n > max_count) throw ProtocolError(fmt::format("{} keys (limit {})", n, max_count));
  std::vector<std::string> out;
  out.reserve(n);
  for (uint32_t i = 0; i < n; ++i) out.emplace_back(bytes(max_key));
  return out;
}

void Reader::expect_done() const {
  if (!rest_.empty()) throw ProtocolError(fmt::format("{} unexpected bytes", rest_.size()));
}

uint32_t frame_length(std::string_view header) {
  DDP_ASSERT(header.size() >= 4, "header of {} bytes", header.size());
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(header[i]);
  return v;
}

std::string job_key(std::string_view secret, std::string_view run_id) {
  if (!secret.empty()) return fmt::format("secret\n{}", secret);
  return fmt::format("run id\n{}", run_id);
}

Nonce random_nonce() {
  Nonce n{};
  size_t done = 0;
  while (done < n.size()) {
    const ssize_t got = ::getrandom(n.data() + done, n.size() - done, 0);
    if (got < 0 && errno == EINTR) continue;
    DDP_ASSERT(got > 0, "getrandom: {}", std::strerror(errno));
    done += static_cast<size_t>(got);
  }
  return n;
}

Proof client_proof(std::string_view key, const Nonce& server_nonce, const Nonce& client_nonce) {
  return hmac(key, kClientLabel, server_nonce, client_nonce);
}

Proof server_proof(std::string_view key, const Nonce& client_nonce, const Nonce& server_nonce) {
  return hmac(key, kServerLabel, client_nonce, server_nonce);
}

bool proofs_equal(std::string_view a, const Proof& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), b.size()) == 0;
}

std::string greeting(const Nonce& server_nonce) {
  Writer w;
  w.raw(kMagic).u8(kVersion).raw(
      {reinterpret_cast<const char*>(server_nonce.data()), server_nonce.size()});
  return w.frame();
}

std::optional<Nonce> parse_greeting(std::string_view body) {
  if (body.size() != kMagic.size() + 1 + kNonceBytes || body.substr(0, kMagic.size()) != kMagic) {
    return std::nullopt;
  }
  Nonce n{};
  std::memcpy(n.data(), body.data() + kMagic.size() + 1, n.size());
  return n;
}

std::string hello(const Nonce& client_nonce, const Proof& proof, std::string_view identity) {
  Writer w;
  w.raw(kMagic)
      .u8(kVersion)
      .raw({reinterpret_cast<const char*>(client_nonce.data()), client_nonce.size()})
      .raw(view(proof))
      .bytes(identity.substr(0, kMaxIdentityBytes));
  return w.frame();
}

Hello parse_hello(std::string_view body) {
  Reader r(body);
  if (r.raw(std::min(body.size(), kMagic.size())) != kMagic) {
    throw ProtocolError("not the store's handshake");
  }
  const uint8_t version = r.u8();
  if (version != kVersion) {
    throw ProtocolError(
        fmt::format("protocol version {} (this store speaks {}: the ranks run "
                    "different builds of ddp-cpp)",
                    version, kVersion));
  }
  Hello h;
  std::memcpy(h.nonce.data(), r.raw(kNonceBytes).data(), kNonceBytes);
  h.proof = std::string(r.raw(kProofBytes));
  h.identity = std::string(r.bytes(kMaxIdentityBytes));
  r.expect_done();
  return h;
}

std::string printable(std::string_view bytes, size_t max) {
  std::string out;
  for (size_t i = 0; i < bytes.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    if (c == '\r')
      out += "\\r";
    else if (c == '\n')
      out += "\\n";
    else if (c == '"' || c == '\\')
      out += fmt::format("\\{}", static_cast<char>(c));
    else if (c >= 0x20 && c < 0x7f)
      out += static_cast<char>(c);
    else
      out += fmt::format("\\x{:02x}", c);
  }
  if (bytes.size() > max) out += "...";
  return out;
}

}  // namespace ddp::store
