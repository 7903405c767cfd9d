// The two check macros (see STYLE: user errors vs our own invariants).
//
//   DDP_CHECK(cond, ErrorType, "fmt {}", args...)  a user or environment error: throws ErrorType
//   DDP_ASSERT(cond, "fmt {}", args...)            a bug in ddp-cpp: throws ddp::InternalError
#pragma once

#include <fmt/format.h>

#include "ddp/error.h"

#define DDP_CHECK(cond, ErrorType, ...)                     \
  do {                                                      \
    if (!(cond)) throw ErrorType(fmt::format(__VA_ARGS__)); \
  } while (0)

#define DDP_ASSERT(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond))                                                                           \
      throw ::ddp::InternalError(fmt::format("internal error at {}:{} ({}): {}", __FILE__, \
                                             __LINE__, #cond, fmt::format(__VA_ARGS__)));  \
  } while (0)
