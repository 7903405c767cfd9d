# CLI11 2.1 (Debian bookworm's headers, vendored by scripts/gpu-check/bundle.sh): header-only.
include("${CMAKE_CURRENT_LIST_DIR}/../vendor.cmake")
if(NOT TARGET CLI11::CLI11)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  set_target_properties(CLI11::CLI11 PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${DDP_GPU_CHECK_VENDOR}/include")
endif()
set(CLI11_VERSION 2.1.2)
