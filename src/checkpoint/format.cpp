// Checkpoint header encoding and verified reading (Note [Checkpoint file format]).
#include "checkpoint/format.h"

#include <fcntl.h>     // open
#include <sys/stat.h>  // fstat, S_ISREG

#include <cerrno>
#include <cstring>  // memcpy, memcmp

#include <fmt/format.h>
#include <openssl/evp.h>  // EVP_Digest*: SHA-256

#include "base/check.h"
#include "ddp/checkpoint.h"  // the error types, kCheckpointFormatVersion, kMax...MetadataBytes

namespace ddp::ckpt {
namespace {

constexpr uint64_t kChunkBytes = 1 << 20;  // streaming verification reads 1 MiB at a time

void put_u32(std::string& out, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_u64(std::string& out, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Printable rendering of unknown magic bytes: "DDP-CKPT" or "\x00\x01...".
std::string show_bytes(const unsigned char* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\') {
      out += static_cast<char>(p[i]);
    } else {
      out += fmt::format("\\x{:02x}", p[i]);
    }
  }
  return out;
}

}  // namespace

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  DDP_ASSERT(ctx_ != nullptr, "EVP_MD_CTX_new failed");
  DDP_ASSERT(EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) == 1,
             "EVP_DigestInit_ex(sha256) failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::update(const void* data, size_t size) {
  DDP_ASSERT(EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, size) == 1,
             "EVP_DigestUpdate failed");
}

Digest Sha256::finish() {
  Digest d{};
  unsigned int n = 0;
  DDP_ASSERT(EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), d.data(), &n) == 1 && n == 32,
             "EVP_DigestFinal_ex failed");
  return d;
}

Digest sha256(std::string_view bytes) {
  Sha256 h;
  h.update(bytes.data(), bytes.size());
  return h.finish();
}

std::string hex(const Digest& d) {
  std::string out;
  out.reserve(64);
  for (unsigned char c : d) out += fmt::format("{:02x}", c);
  return out;
}

std::string encode_head(std::string_view metadata, std::string_view payload) {
  return encode_head(metadata, std::vector<std::string_view>{payload});
}

std::string encode_head(std::string_view metadata, const std::vector<std::string_view>& payload) {
  DDP_ASSERT(metadata.size() <= kMaxCheckpointMetadataBytes, "metadata of {} bytes",
             metadata.size());
  std::string head(kHeaderBytes, '\0');
  std::memcpy(head.data(), kMagic.data(), kMagic.size());
  put_u32(head, 8, kCheckpointFormatVersion);
  put_u32(head, 12, static_cast<uint32_t>(metadata.size()));
  uint64_t payload_size = 0;
  Sha256 payload_hash;
  for (std::string_view part : payload) {
    payload_size += part.size();
    payload_hash.update(part.data(), part.size());
  }
  put_u64(head, 16, payload_size);
  const Digest payload_digest = payload_hash.finish();
  std::memcpy(head.data() + 24, payload_digest.data(), 32);
  Sha256 h;
  h.update(head.data(), kHeaderHashedBytes);
  h.update(metadata.data(), metadata.size());
  const Digest head_digest = h.finish();
  std::memcpy(head.data() + kHeaderHashedBytes, head_digest.data(), 32);
  head.append(metadata);
  return head;
}

void CheckpointFile::corrupt(std::string_view what) const {
  throw CorruptCheckpointError(fmt::format("{}: {}", name_, what));
}

CheckpointFile::CheckpointFile(const fs::path& path) : name_(path.string()), path_(path) {
  fd_ = Fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd_.get() < 0) {
    const int err = errno;
    throw CheckpointError(
        fmt::format("{}: cannot open the checkpoint: {}", path.string(), errno_text(err)));
  }
  struct stat st {};
  if (::fstat(fd_.get(), &st) != 0) {
    const int err = errno;
    throw CheckpointError(
        fmt::format("{}: cannot stat the checkpoint: {}", path.string(), errno_text(err)));
  }
  if (!S_ISREG(st.st_mode)) corrupt("not a regular file");
  file_size_ = static_cast<uint64_t>(st.st_size);
  check_head();
}

CheckpointFile::CheckpointFile(std::string_view bytes, std::string name)
    : name_(std::move(name)), bytes_(bytes), file_size_(bytes.size()) {
  check_head();
}

uint64_t CheckpointFile::read(uint64_t offset, void* out, uint64_t size) const {
  if (fd_.get() >= 0) return read_at(fd_.get(), path_, offset, out, size);
  if (offset >= bytes_.size()) return 0;
  const uint64_t n = std::min<uint64_t>(size, bytes_.size() - offset);
  std::memcpy(out, bytes_.data() + offset, n);
  return n;
}

void CheckpointFile::check_head() {
  if (file_size_ == 0) corrupt("the file is empty (0 bytes)");
  unsigned char head[kHeaderBytes];
  const uint64_t got = read(0, head, kHeaderBytes);
  // The magic first: a short file that is not ours at all should say so.
  if (got < kMagic.size() || std::memcmp(head, kMagic.data(), kMagic.size()) != 0) {
    corrupt(fmt::format("not a ddp-cpp checkpoint: it starts with \"{}\", expected \"{}\"",
                        show_bytes(head, std::min<uint64_t>(got, kMagic.size())),
                        std::string(kMagic.data(), kMagic.size())));
  }
  if (got < kHeaderBytes) {
    corrupt(fmt::format("truncated: the file has {} bytes, less than the {}-byte header",
                        file_size_, kHeaderBytes));
  }
  version_ = get_u32(head + 8);
  const uint32_t meta_size = get_u32(head + 12);
  payload_size_ = get_u64(head + 16);
  std::memcpy(payload_digest_.data(), head + 24, 32);
  Digest header_digest{};
  std::memcpy(header_digest.data(), head + kHeaderHashedBytes, 32);

  // A damaged header can hold any numbers. Verify the header checksum first whenever the
  // metadata it covers is present, so that damage is not reported as truncation (or as a
  // version we do not know); only then compare the declared lengths with the file.
  if (meta_size > kMaxCheckpointMetadataBytes) {
    corrupt(fmt::format("damaged header: it declares {} bytes of metadata (at most {})", meta_size,
                        kMaxCheckpointMetadataBytes));
  }
  if (kHeaderBytes + meta_size > file_size_) {
    corrupt(
        fmt::format("truncated (or a damaged header): the file has {} bytes, its header "
                    "declares {} bytes of metadata after the {}-byte header",
                    file_size_, meta_size, kHeaderBytes));
  }
  metadata_.resize(meta_size);
  if (read(kHeaderBytes, metadata_.data(), meta_size) != meta_size) {
    corrupt("the file shrank while being read");
  }
  Sha256 h;
  h.update(head, kHeaderHashedBytes);
  h.update(metadata_.data(), metadata_.size());
  const Digest computed = h.finish();
  header_digest_ = header_digest;
  if (computed != header_digest) {
    corrupt(
        fmt::format("header checksum mismatch (stored {}, computed {}): the header or the "
                    "metadata is damaged",
                    hex(header_digest).substr(0, 16), hex(computed).substr(0, 16)));
  }
  const uint64_t declared = kHeaderBytes + meta_size;  // + payload, below without overflow
  if (payload_size_ > file_size_ - declared) {
    corrupt(
        fmt::format("truncated: the file has {} bytes, its header declares {} ({} header + "
                    "{} metadata + {} payload); the write was interrupted or the file was "
                    "cut",
                    file_size_, declared + payload_size_, kHeaderBytes, meta_size, payload_size_));
  }
  if (payload_size_ < file_size_ - declared) {
    corrupt(fmt::format("{} unexpected bytes after the {} bytes its header declares",
                        file_size_ - declared - payload_size_, declared + payload_size_));
  }
  if (version_ < kOldestReadableFormat || version_ > kCheckpointFormatVersion) {
    corrupt(fmt::format("format version {}; this build of ddp-cpp reads versions {} to {}",
                        version_, kOldestReadableFormat, kCheckpointFormatVersion));
  }
}

void CheckpointFile::check_digest(const Digest& got) const {
  if (got != payload_digest_) {
    corrupt(
        fmt::format("payload checksum mismatch (header says {}, the {} payload bytes hash "
                    "to {}): the file is damaged",
                    hex(payload_digest_).substr(0, 16), payload_size_, hex(got).substr(0, 16)));
  }
}

std::string CheckpointFile::read_payload() const {
  std::string payload(payload_size_, '\0');
  const uint64_t offset = kHeaderBytes + metadata_.size();
  if (read(offset, payload.data(), payload_size_) != payload_size_) {
    corrupt("the file shrank while being read");
  }
  check_digest(sha256(payload));
  return payload;
}

void CheckpointFile::verify_payload() const {
  Sha256 h;
  std::string buf(std::min(kChunkBytes, payload_size_), '\0');
  uint64_t offset = kHeaderBytes + metadata_.size();
  uint64_t left = payload_size_;
  while (left > 0) {
    const uint64_t n = std::min<uint64_t>(left, buf.size());
    if (read(offset, buf.data(), n) != n) {
      corrupt("the file shrank while being read");
    }
    h.update(buf.data(), n);
    offset += n;
    left -= n;
  }
  check_digest(h.finish());
}

}  // namespace ddp::ckpt
