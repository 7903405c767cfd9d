// Readable C++ type names: "torch::optim::AdamW" for typeid(AdamW).name(). Torch-free.
#pragma once

#include <string>
#include <typeinfo>

namespace ddp {

// The demangled form of `mangled` (a typeid name); `mangled` itself when it cannot be.
std::string demangle(const char* mangled);

// The dynamic type of `object`, demangled.
template <typename T>
std::string type_name_of(const T& object) {
  return demangle(typeid(object).name());
}

}  // namespace ddp
