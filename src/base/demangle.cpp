// Demangled type names (base/demangle.h).
#include "base/demangle.h"

#include <cxxabi.h>  // abi::__cxa_demangle

#include <cstdlib>
#include <memory>

namespace ddp {

std::string demangle(const char* mangled) {
  int status = 0;
  const std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(mangled, nullptr, nullptr,
                                                                        &status),
                                                    &std::free);
  return status == 0 && name ? std::string(name.get()) : std::string(mangled);
}

}  // namespace ddp
