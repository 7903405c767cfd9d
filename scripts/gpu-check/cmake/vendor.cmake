# Where scripts/gpu-check/bundle.sh put the vendored headers: DDP_GPU_CHECK_VENDOR (run.sh passes
# it), else scripts/gpu-check/vendor next to this folder. Included by the package configs beside it.
if(NOT DDP_GPU_CHECK_VENDOR)
  get_filename_component(DDP_GPU_CHECK_VENDOR "${CMAKE_CURRENT_LIST_DIR}/../vendor" ABSOLUTE)
endif()
if(NOT EXISTS "${DDP_GPU_CHECK_VENDOR}/MANIFEST")
  message(FATAL_ERROR "no GPU-check bundle in ${DDP_GPU_CHECK_VENDOR}: run scripts/gpu-check/bundle.sh")
endif()
