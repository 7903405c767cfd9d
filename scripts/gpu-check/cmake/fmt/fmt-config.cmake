# fmt 9 (Debian bookworm's headers, vendored by scripts/gpu-check/bundle.sh), header-only: the
# GPU machine has no libfmt. The include folder is a plain -I (not -isystem, as imported targets'
# folders usually are), so that it comes before LibTorch's -isystem folders: a pip PyTorch may ship
# another fmt in torch/include, and ddp-cpp is written and tested against fmt 9.
# DDP_GPU_CHECK_FMT_INCLUDE (run.sh's GPU_CHECK_FMT=torch) names another folder holding fmt/, the
# way out if LibTorch's own headers turn out to need their fmt.
include("${CMAKE_CURRENT_LIST_DIR}/../vendor.cmake")
if(NOT DDP_GPU_CHECK_FMT_INCLUDE)
  set(DDP_GPU_CHECK_FMT_INCLUDE "${DDP_GPU_CHECK_VENDOR}/fmt/include")
endif()
if(NOT TARGET fmt::fmt)
  add_library(fmt::fmt INTERFACE IMPORTED)
  set_target_properties(fmt::fmt PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${DDP_GPU_CHECK_FMT_INCLUDE}"
    INTERFACE_COMPILE_DEFINITIONS "FMT_HEADER_ONLY=1")
  if(NOT CMAKE_VERSION VERSION_LESS 3.25)
    set_target_properties(fmt::fmt PROPERTIES SYSTEM FALSE)
  elseif(NOT CMAKE_VERSION VERSION_LESS 3.23)
    set_target_properties(fmt::fmt PROPERTIES IMPORTED_NO_SYSTEM TRUE)
  endif()  # older CMake: -isystem, after LibTorch's or before, as the link order falls
endif()
set(fmt_VERSION 9.1.0)  # of the vendored one
