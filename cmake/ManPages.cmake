# Man pages of the tools, generated at build time from their --help by help2man (Debian's
# help2man), so that they never drift from the flags: ddprun.1, ddp-train.1, ddp-bench.1, gzipped
# as Debian installs man pages, into share/man/man1 (component tools: the ddp-tools package).
# Without help2man the build goes on without them (scripts/test-deb.sh fails on a package
# without them).
# Sanitizer builds (scripts/sanitize.sh) make none: a leak report at a tool's exit would fail it.
option(DDP_BUILD_MAN_PAGES "Generate the tools' man pages with help2man" ON)
if(NOT DDP_BUILD_MAN_PAGES OR DDP_SANITIZE)
  return()
endif()
find_program(DDP_HELP2MAN help2man)
find_program(DDP_GZIP gzip)
if(NOT DDP_HELP2MAN OR NOT DDP_GZIP)
  message(STATUS "ddp: no man pages (help2man or gzip not found; apt install help2man)")
  return()
endif()

# ddp_add_man_page(<program target> <one-line description>)
# The program runs from its build folder through PATH, so the page shows its name, not the build
# path (CLI11 prints argv[0] in "Usage:"). None of the tools has --version: the project's version
# is given instead. help2man dates the page by SOURCE_DATE_EPOCH when it is set (reproducible).
function(ddp_add_man_page program description)
  set(page ${PROJECT_BINARY_DIR}/man/${program}.1)
  add_custom_command(
    OUTPUT ${page}.gz
    COMMAND ${CMAKE_COMMAND} -E make_directory ${PROJECT_BINARY_DIR}/man
    COMMAND ${CMAKE_COMMAND} -E env "PATH=$<TARGET_FILE_DIR:${program}>:$ENV{PATH}"
            ${DDP_HELP2MAN} --no-info --no-discard-stderr --section=1
            --version-string=${PROJECT_VERSION} --name=${description} --output=${page}
            ${program}
    COMMAND ${DDP_GZIP} -9nf ${page}  # -n: no name or time stamp in the .gz (reproducible)
    DEPENDS ${program}
    COMMENT "Man page ${program}.1 (help2man)"
    VERBATIM)
  add_custom_target(${program}_man ALL DEPENDS ${page}.gz)
  install(FILES ${page}.gz DESTINATION ${CMAKE_INSTALL_MANDIR}/man1 COMPONENT tools)
endfunction()

ddp_add_man_page(ddprun "start and supervise the workers of a data-parallel job, like torchrun")
ddp_add_man_page(ddp-train "train a model on Fashion-MNIST with DistributedDataParallel")
ddp_add_man_page(ddp-bench "measure collectives and training throughput, nccl-tests style")
