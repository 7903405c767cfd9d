// The store's wire format, handshake proofs and where it listens: pure logic, no sockets.
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "store/bind.h"
#include "store/protocol.h"

namespace ddp::store {
namespace {

TEST(StoreProtocol, FieldsRoundTripAndEveryReadIsBounded) {
  Writer w;
  w.u8(7).u32(0xdeadbeef).i64(-42).bytes("key").keys({"a", "bc"});
  const std::string frame = w.frame();
  ASSERT_EQ(frame_length(frame), frame.size() - kFrameHeaderBytes);
  Reader r(std::string_view(frame).substr(kFrameHeaderBytes));
  EXPECT_EQ(r.u8(), 7);
  EXPECT_EQ(r.u32(), 0xdeadbeefu);
  EXPECT_EQ(r.i64(), -42);
  EXPECT_EQ(r.bytes(16), "key");
  EXPECT_EQ(r.keys(4, 4), (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(r.done());
  EXPECT_THROW(r.u8(), ProtocolError);  // nothing left

  // A field longer than allowed is refused before anything is copied.
  Writer big;
  big.bytes(std::string(100, 'x'));
  Reader rb(big.body());
  EXPECT_THROW(rb.bytes(99), ProtocolError);
  // A length prefix promising more than the frame holds.
  Writer lying;
  lying.u32(1u << 30).raw("abc");
  Reader rl(lying.body());
  EXPECT_THROW(rl.bytes(size_t{1} << 31), ProtocolError);
  // Too many keys.
  Writer many;
  many.keys({"a", "b", "c"});
  Reader rm(many.body());
  EXPECT_THROW(rm.keys(2, 10), ProtocolError);
}

TEST(StoreProtocol, HandshakeProofsNeedTheKeyAndBothNonces) {
  const Nonce s = random_nonce(), c = random_nonce();
  EXPECT_NE(s, c);
  const std::string key = job_key("secret", "run");
  EXPECT_NE(key, job_key("", "run"));  // a secret and a run id never collide
  EXPECT_NE(key, job_key("other", "run"));
  EXPECT_EQ(job_key("", "run"), job_key("", "run"));
  const Proof p = client_proof(key, s, c);
  EXPECT_TRUE(proofs_equal({reinterpret_cast<const char*>(p.data()), p.size()}, p));
  EXPECT_NE(p, client_proof(job_key("other", "run"), s, c));
  EXPECT_NE(p, client_proof(key, c, s));
  EXPECT_NE(p, client_proof(key, s, random_nonce()));
  // The server's proof is not the client's reflected back.
  EXPECT_NE(p, server_proof(key, s, c));
  EXPECT_NE(client_proof(key, s, c), server_proof(key, c, s));
  EXPECT_FALSE(proofs_equal("short", p));
}

TEST(StoreProtocol, GreetingAndHelloParse) {
  const Nonce s = random_nonce();
  const std::string g = greeting(s);
  auto parsed = parse_greeting(std::string_view(g).substr(kFrameHeaderBytes));
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(*parsed, s);
  EXPECT_FALSE(parse_greeting("HTTP/1.1 400 Bad Request\r\n").has_value());

  const Nonce c = random_nonce();
  const Proof p = client_proof("k", s, c);
  const std::string h = hello(c, p, "rank 1, pid 7 on host");
  ASSERT_LE(frame_length(h), kMaxHelloBytes);
  const Hello back = parse_hello(std::string_view(h).substr(kFrameHeaderBytes));
  EXPECT_EQ(back.nonce, c);
  EXPECT_TRUE(proofs_equal(back.proof, p));
  EXPECT_EQ(back.identity, "rank 1, pid 7 on host");
  // An identity longer than the limit is cut, so a hello always fits in kMaxHelloBytes.
  EXPECT_LE(frame_length(hello(c, p, std::string(10000, 'i'))), kMaxHelloBytes);

  EXPECT_THROW(parse_hello("GET / HTTP/1.1\r\n\r\n"), ProtocolError);
  std::string wrong_version(std::string_view(h).substr(kFrameHeaderBytes));
  wrong_version[kMagic.size()] = 9;
  try {
    parse_hello(wrong_version);
    FAIL();
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("version 9"), std::string::npos) << e.what();
  }
}

TEST(StoreProtocol, PrintableEscapesWhatAStrangerSent) {
  EXPECT_EQ(printable("GET / HTTP/1.1\r\n"), "GET / HTTP/1.1\\r\\n");
  EXPECT_EQ(printable(std::string("\x00\xff\"", 3)), "\\x00\\xff\\\"");
  EXPECT_EQ(printable(std::string(100, 'a'), 4), "aaaa...");
}

SocketAddress addr(const std::string& ip) {
  SocketAddress a;
  EXPECT_TRUE(parse_ip(ip, 0, a)) << ip;
  return a;
}

TEST(StoreBind, ListensWhereTheRanksReachIt) {
  auto local = [](const SocketAddress& a) { return ip_of(a) == "10.0.0.5"; };
  auto resolver = [](const std::string& name) -> std::vector<SocketAddress> {
    if (name == "node0") return {addr("10.0.0.5")};
    if (name == "debian-host") return {addr("127.0.1.1")};
    if (name == "localhost") return {addr("127.0.0.1"), addr("::1")};
    if (name == "elsewhere") return {addr("10.9.9.9")};
    return {};
  };
  auto plan = [&](const std::string& master, bool single, const std::string& override_addr = "") {
    return plan_bind(master, single, override_addr, local, resolver);
  };
  using V = std::vector<std::string>;
  // ddprun --standalone: loopback only.
  EXPECT_EQ(plan("127.0.0.1", true).addresses, V{"127.0.0.1"});
  EXPECT_EQ(plan("localhost", true).addresses, (V{"127.0.0.1", "::1"}));
  // A literal of this host, or a name resolving to one: exactly that.
  EXPECT_EQ(plan("10.0.0.5", false).addresses, V{"10.0.0.5"});
  EXPECT_EQ(plan("node0", false).addresses, V{"10.0.0.5"});
  // Loopback names are fine when every rank is here, and say nothing about other hosts.
  EXPECT_EQ(plan("debian-host", true).addresses, V{"127.0.1.1"});
  BindPlan p = plan("debian-host", false);
  EXPECT_TRUE(p.addresses.empty());
  EXPECT_NE(p.why_every_interface.find("loopback"), std::string::npos) << p.why_every_interface;
  // Not an address of this host (NAT), or unknown: every interface, with the reason.
  p = plan("203.0.113.7", false);
  EXPECT_TRUE(p.addresses.empty());
  EXPECT_NE(p.why_every_interface.find("not an address of this host"), std::string::npos);
  p = plan("elsewhere", true);
  EXPECT_TRUE(p.addresses.empty());
  EXPECT_NE(p.why_every_interface.find("10.9.9.9"), std::string::npos) << p.why_every_interface;
  p = plan("no-such-name", false);
  EXPECT_TRUE(p.addresses.empty());
  EXPECT_NE(p.why_every_interface.find("does not resolve"), std::string::npos);
  // DDP_STORE_BIND wins.
  EXPECT_EQ(plan("node0", false, "10.0.0.5,127.0.0.1").addresses, (V{"10.0.0.5", "127.0.0.1"}));
  p = plan("127.0.0.1", true, "any");
  EXPECT_TRUE(p.addresses.empty());
  EXPECT_TRUE(p.why_every_interface.empty());  // asked for: no note
  EXPECT_THROW(plan("127.0.0.1", true, "eth0"), ConfigError);
}

}  // namespace
}  // namespace ddp::store
