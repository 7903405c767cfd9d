// A fresh, private directory for a test (mkdtemp under $TMPDIR or /tmp); the caller removes it.
// Throws when it cannot be made, instead of handing back a null path.
#pragma once

#include <stdlib.h>  // mkdtemp

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::testing {

inline std::string make_temp_dir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) {
    throw std::runtime_error("mkdtemp " + tmpl + ": " + std::strerror(errno));
  }
  return buf.data();
}

}  // namespace ddp::testing
