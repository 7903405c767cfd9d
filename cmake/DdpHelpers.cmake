# ddp_add_test(NAME <name> SOURCES <files...> LABEL <labels...>
#              [LIBS <targets...>] [TIMEOUT <s>] [ENV <VAR=value...>]
#              [FAULT <gtest filter> [FAULT_TIMEOUT <s>]] [EACH_CASE] [VERSION_NEUTRAL])
#
# One executable per test file. Every test gets a ctest TIMEOUT, the outer deadline that turns
# a hang into a failure instead of a stuck CI run.
#
# FAULT "Suite.Test*:Suite2.*" (a gtest filter) splits the executable in two ctest entries: NAME
# runs every other test, NAME.fault runs those, labelled LABEL and `fault` (the fault-injection
# suite: `ctest -L fault`), under FAULT_TIMEOUT (default TIMEOUT). A test that is all faults
# takes `LABEL <label> fault` instead.
#
# EACH_CASE: one ctest entry per TEST(Suite, Case) of the sources, NAME.Case, so that a case
# that crashes the process is named and the others still run (the GPU tests: one run on a lent
# machine must report every case). The entries' names are left in NAME_TESTS.
#
# VERSION_NEUTRAL: what the test checks does not depend on LibTorch's version; its entries get
# the label version-neutral, and with DDP_VERSION_NEUTRAL_TESTS=OFF (the LibTorch 2.6 suite) the
# test is not built at all (callers guard what follows with if(TARGET NAME)).
function(ddp_add_test)
  cmake_parse_arguments(T "EACH_CASE;VERSION_NEUTRAL" "NAME;TIMEOUT;FAULT;FAULT_TIMEOUT" "SOURCES;LABEL;LIBS;ENV" ${ARGN})
  if(T_VERSION_NEUTRAL)
    if(NOT DDP_VERSION_NEUTRAL_TESTS)
      return()
    endif()
    list(APPEND T_LABEL version-neutral)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  if(NOT T_FAULT_TIMEOUT)
    set(T_FAULT_TIMEOUT ${T_TIMEOUT})
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE GTest::gtest GTest::gtest_main fmt::fmt ${T_LIBS})
  ddp_test_program(${T_NAME})
  set(environment "DDP_BUILD_DIR=${PROJECT_BINARY_DIR};${T_ENV}")
  if(T_FAULT)
    add_test(NAME ${T_NAME} COMMAND ${T_NAME} --gtest_filter=-${T_FAULT})
    add_test(NAME ${T_NAME}.fault COMMAND ${T_NAME} --gtest_filter=${T_FAULT})
    set_tests_properties(${T_NAME}.fault PROPERTIES LABELS "${T_LABEL};fault"
                         TIMEOUT ${T_FAULT_TIMEOUT} ENVIRONMENT "${environment}")
  elseif(T_EACH_CASE)
    set(tests)
    foreach(source ${T_SOURCES})
      set(path ${CMAKE_CURRENT_SOURCE_DIR}/${source})
      set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${path})
      file(STRINGS ${path} lines REGEX "^TEST(_F)?\\(")
      foreach(line ${lines})
        string(REGEX REPLACE "^TEST(_F)?\\(([A-Za-z0-9_]+), *([A-Za-z0-9_]+)\\).*" "\\2;\\3"
               suite_case "${line}")
        list(GET suite_case 0 suite)
        list(GET suite_case 1 case)
        add_test(NAME ${T_NAME}.${case} COMMAND ${T_NAME} --gtest_filter=${suite}.${case})
        list(APPEND tests ${T_NAME}.${case})
      endforeach()
    endforeach()
    set_tests_properties(${tests} PROPERTIES LABELS "${T_LABEL}" TIMEOUT ${T_TIMEOUT}
                         ENVIRONMENT "${environment}")
    set(${T_NAME}_TESTS ${tests} PARENT_SCOPE)
    return()
  else()
    add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABEL}" TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "${environment}")
endfunction()

# ddp_test_program(<target>): what every program of the suite shares, the tests and the workers
# they start: the test files' optimisation (DDP_TEST_OPTIMIZE, for build speed), tests/ and src/
# on the include path (tests may reach internals to test pure logic alone), GoogleTest's and fmt's
# compile flags, and the suite's precompiled LibTorch header for the sources that reach LibTorch
# (Note [Precompiled LibTorch]).
function(ddp_test_program target)
  if(DDP_TEST_OPTIMIZE)
    target_compile_options(${target} PRIVATE ${DDP_TEST_OPTIMIZE})
  endif()
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${target} PRIVATE GTest::gtest fmt::fmt)
  if(TARGET ddp_test_pch AND NOT target STREQUAL "ddp_test_pch")
    ddp_precompile_libtorch(${target} REUSE_FROM ddp_test_pch)
  endif()
endfunction()

# Note [Precompiled LibTorch]
# A source that includes LibTorch spends most of its compile parsing it: GCC reads ~1 GB of
# templates for <torch/torch.h>, ~18 s of a test file's ~30 s, and 6-8 s of a library file's
# 10-20 s. A precompiled header takes that parsing out: one per set of compile flags, because
# GCC takes a header only when the flags it was made with match (-fPIC and -fPIE differ;
# -Winvalid-pch on every user names a mismatch in the build log instead of quietly parsing the
# header again). There are three:
#   - libddp's own (-fPIC), of the LibTorch headers the library uses (src/CMakeLists.txt);
#   - ddp_tools_pch (an executable: -fPIE), <torch/torch.h> for the tools, examples and
#     benchmarks (tools/CMakeLists.txt; the tools' static libraries compile as -fPIE to share it:
#     only executables link them);
#   - ddp_test_pch, <torch/torch.h> and GoogleTest at the test files' flags (tests/CMakeLists.txt).
# CMake's per-target header would build one per program (~40 s each, slower than none), so the
# programs reuse one (REUSE_FROM). A source that does not reach LibTorch skips it: loading the
# header (~3 s) costs more than such a file's whole compile (ddp_base, the store, ddprun). Which
# sources reach it is read from their includes at configure time (ddp_reaches_libtorch); a source
# that gains a LibTorch include compiles correctly without the header until CMake runs again.
# A user may define more macros than its header was made with, never fewer, so a header's
# target links only what all its users link. The header is included before each source
# (-include): a LibTorch include missing from a source does not show until a build with
# -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON, which makes none.
# ccache caches these compiles when told the header's defines and times are its to ignore
# (CCACHE_SLOPPINESS, set by the top CMakeLists.txt).

# ddp_tool_target(<target>): a tool's library or program, an example or a benchmark. Compiled as
# position-independent executable code, which is what they end up in (a static library here is
# linked only into programs), so that its sources share ddp_tools_pch's precompiled header.
function(ddp_tool_target target)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "STATIC_LIBRARY")
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${target} PRIVATE -fPIE)
  endif()
  ddp_precompile_libtorch(${target} REUSE_FROM ddp_tools_pch)
endfunction()

# ddp_precompile_libtorch(<target> REUSE_FROM <pch target> | HEADERS <headers...>): <target>'s
# sources that reach LibTorch compile with a precompiled header, its own of HEADERS or that of
# the target REUSE_FROM names; the others skip it. A target none of whose sources reach LibTorch
# gets none.
function(ddp_precompile_libtorch target)
  cmake_parse_arguments(P "" "REUSE_FROM" "HEADERS" ${ARGN})
  # A program that does not link LibTorch lacks its flags (a test that reaches <ATen/...> through
  # a header of ours, from /usr/include, for a type alone): the header would not fit.
  ddp_links_libtorch(${target} links)
  if(NOT links)
    return()
  endif()
  get_target_property(sources ${target} SOURCES)
  get_target_property(folder ${target} SOURCE_DIR)
  set(reaching 0)
  foreach(source ${sources})
    if(source MATCHES "^\\$<")  # $<TARGET_OBJECTS:...>: another target's objects
      continue()
    endif()
    if(NOT IS_ABSOLUTE ${source})
      set(source ${folder}/${source})
    endif()
    ddp_reaches_libtorch(${source} reaches)
    if(reaches)
      math(EXPR reaching "${reaching} + 1")
    else()
      set_source_files_properties(${source} TARGET_DIRECTORY ${target}
                                  PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
    endif()
  endforeach()
  if(NOT reaching)
    return()
  endif()
  if(P_REUSE_FROM)
    target_precompile_headers(${target} REUSE_FROM ${P_REUSE_FROM})
  else()
    target_precompile_headers(${target} PRIVATE ${P_HEADERS})
  endif()
  target_compile_options(${target} PRIVATE -Winvalid-pch)
endfunction()

# ddp_links_libtorch(<target> <out>): TRUE when <target> links LibTorch (torch, or ddp), itself
# or through a library of this project it links.
function(ddp_links_libtorch target out)
  get_target_property(aliased ${target} ALIASED_TARGET)
  if(aliased)
    set(target ${aliased})
  endif()
  set(answer FALSE)
  if(target STREQUAL "torch" OR target STREQUAL "ddp")
    set(answer TRUE)
  else()
    get_target_property(imported ${target} IMPORTED)
    if(NOT imported)
      get_target_property(libs ${target} LINK_LIBRARIES)
      foreach(lib ${libs})
        if(TARGET ${lib})
          ddp_links_libtorch(${lib} links)
          if(links)
            set(answer TRUE)
            break()
          endif()
        endif()
      endforeach()
    endif()
  endif()
  set(${out} ${answer} PARENT_SCOPE)
endfunction()

# ddp_reaches_libtorch(<file> <out>): TRUE when <file> includes a LibTorch header (<torch/...>,
# <ATen/...>, <c10/...>) itself or through headers of this project, at any depth. A quoted
# include is looked for beside the file, then under include/, src/, tests/ and tools/common/;
# one found nowhere (a system header) does not count. Answers are kept for the configure run.
function(ddp_reaches_libtorch file out)
  string(MD5 key "${file}")
  get_property(known GLOBAL PROPERTY DDP_REACHES_LIBTORCH_${key} SET)
  if(known)
    get_property(answer GLOBAL PROPERTY DDP_REACHES_LIBTORCH_${key})
    set(${out} ${answer} PARENT_SCOPE)
    return()
  endif()
  # FALSE while it is read: an include cycle ends here.
  set_property(GLOBAL PROPERTY DDP_REACHES_LIBTORCH_${key} FALSE)
  set(answer FALSE)
  if(EXISTS ${file})
    file(STRINGS ${file} includes REGEX "^#include [<\"]")
    get_filename_component(folder ${file} DIRECTORY)
    foreach(line ${includes})
      if(line MATCHES "^#include <(torch|ATen|c10)/")
        set(answer TRUE)
        break()
      endif()
      if(NOT line MATCHES "^#include [<\"](ddp/[^>\"]+)[>\"]" AND
         NOT line MATCHES "^#include \"([^\"]+)\"")
        continue()
      endif()
      set(header ${CMAKE_MATCH_1})
      foreach(dir ${folder} ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src
                  ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/tools/common)
        if(EXISTS ${dir}/${header})
          ddp_reaches_libtorch(${dir}/${header} reaches)
          if(reaches)
            set(answer TRUE)
          endif()
          break()
        endif()
      endforeach()
      if(answer)
        break()
      endif()
    endforeach()
  endif()
  set_property(GLOBAL PROPERTY DDP_REACHES_LIBTORCH_${key} ${answer})
  set(${out} ${answer} PARENT_SCOPE)
endfunction()
