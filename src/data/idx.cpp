// IDX reader (the MNIST file format) over zlib: .gz and uncompressed files alike.
//
// LibTorch's MNIST reader does not check that the payload read completed, so a truncated file
// yields silent zeros. Here every byte the header promises must arrive, nothing may follow it,
// and the gzip stream must end with a good CRC; anything else names the file and the problem.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <vector>

#include <zlib.h>  // gzopen, gzread, gzerror, gzclose

#include <ATen/ops/empty.h>  // at::empty

#include "base/check.h"
#include "ddp/datasets.h"

namespace ddp {
namespace {

constexpr uint32_t kImagesMagic = 2051;  // 0x00000803: uint8 data, 3 dimensions
constexpr uint32_t kLabelsMagic = 2049;  // 0x00000801: uint8 data, 1 dimension
// A corrupt header could declare terabytes; refuse before allocating.
constexpr int64_t kMaxPayloadBytes = int64_t{1} << 36;  // 64 GiB
// gzread takes an unsigned int length: read in chunks well below that.
constexpr int64_t kChunkBytes = int64_t{1} << 26;

// One open IDX file; every failure is a DataError that names it.
class IdxFile {
 public:
  explicit IdxFile(std::string path) : path_(std::move(path)) {
    errno = 0;
    gz_ = gzopen(path_.c_str(), "rb");
    DDP_CHECK(gz_ != nullptr, DataError, "{}: cannot open: {}", path_,
              errno ? std::strerror(errno) : "out of memory");
    gzbuffer(gz_, 1 << 17);  // 128 KiB reads instead of 8 KiB: fewer syscalls on 26 MB files
  }
  ~IdxFile() { gzclose(gz_); }
  IdxFile(const IdxFile&) = delete;
  IdxFile& operator=(const IdxFile&) = delete;

  const std::string& path() const { return path_; }

  // Reads up to `len` bytes into dst; returns how many arrived before the end of the data.
  // A damaged gzip stream (bad deflate data, CRC or length check) throws.
  int64_t read(void* dst, int64_t len) {
    auto* out = static_cast<unsigned char*>(dst);
    int64_t total = 0;
    while (total < len) {
      const auto want = static_cast<unsigned>(std::min(len - total, kChunkBytes));
      const int got = gzread(gz_, out + total, want);
      if (got < 0) throw corrupt(total);
      if (got == 0) break;
      total += got;
    }
    if (total < len) {
      int errnum = Z_OK;
      gzerror(gz_, &errnum);
      // Z_BUF_ERROR: the gzip stream itself stops early (a cut .gz file): the caller reports
      // the short read as a truncated file.
      if (errnum != Z_OK && errnum != Z_BUF_ERROR) throw corrupt(total);
      stream_cut_ = errnum == Z_BUF_ERROR;
    }
    bytes_read_ += total;
    return total;
  }

  // Big-endian header of `n` 32-bit fields.
  template <size_t N>
  std::array<uint32_t, N> header(const char* kind) {
    std::array<unsigned char, 4 * N> raw{};
    const int64_t got = read(raw.data(), static_cast<int64_t>(raw.size()));
    DDP_CHECK(got == static_cast<int64_t>(raw.size()), DataError,
              "{}: the IDX {} header is {} bytes, expected {}: the file is truncated (or empty)",
              path_, kind, got, raw.size());
    std::array<uint32_t, N> out{};
    for (size_t i = 0; i < N; ++i) {
      out[i] = (uint32_t{raw[4 * i]} << 24) | (uint32_t{raw[4 * i + 1]} << 16) |
               (uint32_t{raw[4 * i + 2]} << 8) | uint32_t{raw[4 * i + 3]};
    }
    return out;
  }

  // Reads the first `len` of the `declared` payload bytes into dst, the rest into scratch (a
  // limited read still decompresses the whole file, so that its length and its gzip CRC are
  // checked: a damaged file is never half used), then checks that the file ends there. With
  // `check_rest` false a limited read stops after its `len` bytes: only they are checked (their
  // length, and the stream up to them), and the CRC, which covers the whole file, is not.
  void payload(void* dst, int64_t len, int64_t declared, const std::string& what, bool check_rest) {
    int64_t got = read(dst, len);
    if (!check_rest && len < declared) {
      DDP_CHECK(got == len, DataError,
                "{}: expected {} bytes of {} after the header, got {}: the file is truncated{}",
                path_, declared, what, got, stream_cut_ ? " (the gzip stream ends early)" : "");
      return;
    }
    std::vector<unsigned char> scratch(got == len && declared > len ? size_t{1} << 20 : 0);
    while (got == len && len < declared) {
      const int64_t want = std::min<int64_t>(declared - len, static_cast<int64_t>(scratch.size()));
      const int64_t more = read(scratch.data(), want);
      len += want;
      got += more;
    }
    DDP_CHECK(got == len, DataError,
              "{}: expected {} bytes of {} after the header, got {}: the file is truncated{}",
              path_, std::max(len, declared), what, got,
              stream_cut_ ? " (the gzip stream ends early)" : "");
    unsigned char extra[64];
    const int64_t more = read(extra, sizeof(extra));  // also makes zlib verify the CRC
    DDP_CHECK(more == 0, DataError,
              "{}: data continues after the {} bytes of {} the header declares: the count in "
              "the header is wrong or the file is corrupt",
              path_, len, what);
  }

 private:
  DataError corrupt(int64_t at) const {
    int errnum = Z_OK;
    std::string msg = gzerror(gz_, &errnum);
    if (errnum == Z_ERRNO) msg = std::strerror(errno);
    if (msg.rfind(path_ + ": ", 0) == 0) msg.erase(0, path_.size() + 2);  // zlib prefixes it
    return DataError(fmt::format(
        "{}: the gzip stream is corrupt after {} bytes of data ({}): re-download the file or "
        "reinstall its package",
        path_, bytes_read_ + at, msg));
  }

  std::string path_;
  gzFile gz_ = nullptr;
  int64_t bytes_read_ = 0;
  bool stream_cut_ = false;  // the gzip stream ended before its trailer
};

void check_magic(const IdxFile& f, uint32_t magic, uint32_t expected, const char* kind) {
  DDP_CHECK(magic == expected, DataError,
            "{}: magic number {} (0x{:08x}), expected {} for IDX {}: not an IDX {} file, or "
            "a corrupt one",
            f.path(), magic, magic, expected, kind,
            std::string(kind).substr(0, std::strlen(kind) - 1));  // "images" -> "image"
}

}  // namespace

at::Tensor read_idx_images(const std::string& path, int64_t limit, bool check_rest) {
  IdxFile f(path);
  const auto h = f.header<4>("images");  // magic, count, rows, cols
  check_magic(f, h[0], kImagesMagic, "images");
  const int64_t declared = h[1], rows = h[2], cols = h[3];
  DDP_CHECK(rows > 0 && cols > 0, DataError,
            "{}: the header declares {}x{} images: the file is corrupt", path, rows, cols);
  DDP_CHECK(declared * rows * cols <= kMaxPayloadBytes, DataError,
            "{}: the header declares {} images of {}x{} ({} bytes): the count is corrupt", path,
            declared, rows, cols, declared * rows * cols);
  const int64_t count = limit > 0 ? std::min(limit, declared) : declared;
  at::Tensor images = at::empty({count, rows, cols}, at::TensorOptions().dtype(at::kByte));
  f.payload(images.data_ptr<uint8_t>(), count * rows * cols, declared * rows * cols, "pixels",
            check_rest);
  return images;
}

at::Tensor read_idx_labels(const std::string& path, int64_t limit, bool check_rest) {
  IdxFile f(path);
  const auto h = f.header<2>("labels");  // magic, count
  check_magic(f, h[0], kLabelsMagic, "labels");
  const int64_t declared = h[1];
  const int64_t count = limit > 0 ? std::min(limit, declared) : declared;
  at::Tensor labels = at::empty({count}, at::TensorOptions().dtype(at::kByte));
  f.payload(labels.data_ptr<uint8_t>(), count, declared, "labels", check_rest);
  return labels;
}

int64_t read_idx_count(const std::string& path) {
  IdxFile f(path);
  return f.header<2>("header")[1];  // magic, count: the same two fields for images and labels
}

}  // namespace ddp
