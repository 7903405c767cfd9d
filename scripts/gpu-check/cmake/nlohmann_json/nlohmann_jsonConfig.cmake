# nlohmann-json 3.11 (Debian bookworm's headers, vendored by scripts/gpu-check/bundle.sh).
include("${CMAKE_CURRENT_LIST_DIR}/../vendor.cmake")
if(NOT TARGET nlohmann_json::nlohmann_json)
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
  set_target_properties(nlohmann_json::nlohmann_json PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${DDP_GPU_CHECK_VENDOR}/include")
endif()
set(nlohmann_json_VERSION 3.11.2)
