// The checkpoint file layout: encoding the header, and reading a file with every check done
// before its payload reaches LibTorch. Torch-free: SHA-256 from OpenSSL.
//
// Note [Checkpoint file format]
// A checkpoint is one file: a fixed 88-byte header, JSON metadata, then the payload. Integers
// are little-endian.
//   offset  size  field
//        0     8  magic "DDP-CKPT"
//        8     4  format version (u32), kCheckpointFormatVersion
//       12     4  metadata length M (u32, at most kMaxCheckpointMetadataBytes)
//       16     8  payload length P (u64)
//       24    32  SHA-256 of the payload
//       56    32  SHA-256 of bytes [0, 56) followed by the metadata (guards the header itself)
//       88     M  metadata: UTF-8 JSON (step, epoch, world size, hparams, versions, and the
//                 index of the states: each key's scope, JSON and tensors (metadata.h))
//     88+M     P  payload: every state's tensors (Note [State payload] in src/state/codec.h);
//                 format 1: a LibTorch OutputArchive (model, optimizer, per-rank generator
//                 states, blob; read by legacy_v1.h)
// The file is exactly 88 + M + P bytes. Reading checks, in this order: that the file is not
// empty, the magic, the header checksum (over the fixed fields and the metadata, so a damaged
// length or version is reported as damage, not as truncation or a newer format), the declared
// lengths against the file size (truncated, trailing bytes), the version, the metadata, and
// only then it reads the payload and checks its SHA-256: no payload byte is used before they
// matched; the states are checked against the objects after that. Every failure is a
// CorruptCheckpointError naming the file and what was wrong, e.g. "<file>: truncated: the file
// has 5000 bytes, its header declares 7236 (88 header + 1512 metadata + 5636 payload); ...".
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint/file_io.h"

namespace ddp::ckpt {

inline constexpr std::array<char, 8> kMagic = {'D', 'D', 'P', '-', 'C', 'K', 'P', 'T'};
inline constexpr uint64_t kHeaderBytes = 88;
inline constexpr uint64_t kHeaderHashedBytes = 56;  // [0, 56) precede the header checksum
inline constexpr uint32_t kOldestReadableFormat = 1;

using Digest = std::array<unsigned char, 32>;

// Incremental SHA-256.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t size);
  Digest finish();

 private:
  void* ctx_;  // EVP_MD_CTX*
};

Digest sha256(std::string_view bytes);
std::string hex(const Digest& d);

// The 88-byte header (format kCheckpointFormatVersion) followed by the metadata, for this
// payload.
std::string encode_head(std::string_view metadata, std::string_view payload);
// The same for a payload in parts (hashed in place: no copy).
std::string encode_head(std::string_view metadata, const std::vector<std::string_view>& payload);

// An open checkpoint, a file or bytes in memory, whose size, magic, version, lengths and header
// checksum were checked on construction. Every failure is a CorruptCheckpointError (or
// CheckpointError for I/O) whose message starts with the path (or the bytes' name).
class CheckpointFile {
 public:
  explicit CheckpointFile(const fs::path& path);
  // `bytes` must outlive this object; `name` stands for the path in errors.
  CheckpointFile(std::string_view bytes, std::string name);

  const std::string& name() const { return name_; }
  uint32_t version() const { return version_; }
  const std::string& metadata() const { return metadata_; }
  uint64_t payload_size() const { return payload_size_; }
  uint64_t file_size() const { return file_size_; }
  // The header's own checksum (over its fixed fields, which hold the payload's SHA-256, and the
  // metadata): checked on construction, it names these exact bytes.
  const Digest& header_digest() const { return header_digest_; }
  // The payload, after its SHA-256 matched the header's.
  std::string read_payload() const;
  // Checks the payload's SHA-256 without keeping it (reads in chunks).
  void verify_payload() const;
  // A CorruptCheckpointError "<path>: <what>".
  [[noreturn]] void corrupt(std::string_view what) const;

 private:
  void check_head();
  void check_digest(const Digest& got) const;
  // Reads up to `size` bytes at `offset` (fewer only at the end).
  uint64_t read(uint64_t offset, void* out, uint64_t size) const;

  std::string name_;
  fs::path path_;  // a file's,
  Fd fd_;
  std::string_view bytes_;  // or bytes in memory
  uint32_t version_ = 0;
  uint64_t file_size_ = 0;
  uint64_t payload_size_ = 0;
  Digest payload_digest_{};
  Digest header_digest_{};
  std::string metadata_;
};

}  // namespace ddp::ckpt
