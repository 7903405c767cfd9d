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
# compile flags, and LibTorch's precompiled header when a source includes <torch/torch.h> (Note [One
# precompiled LibTorch] in tests/CMakeLists.txt).
function(ddp_test_program target)
  if(DDP_TEST_OPTIMIZE)
    target_compile_options(${target} PRIVATE ${DDP_TEST_OPTIMIZE})
  endif()
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${target} PRIVATE GTest::gtest fmt::fmt)
  if(NOT TARGET ddp_test_pch OR target STREQUAL "ddp_test_pch")
    return()
  endif()
  # The sources and the test headers they include (tests/support/, their own folder), one deep.
  get_target_property(files ${target} SOURCES)
  foreach(source ${files})
    get_filename_component(path ${source} ABSOLUTE)
    get_filename_component(folder ${path} DIRECTORY)
    file(STRINGS ${path} includes REGEX "^#include \"[^\"]+\"")
    foreach(line ${includes})
      string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" header "${line}")
      foreach(dir ${folder} ${PROJECT_SOURCE_DIR}/tests)
        if(EXISTS ${dir}/${header})
          list(APPEND files ${dir}/${header})
        endif()
      endforeach()
    endforeach()
  endforeach()
  foreach(file ${files})
    get_filename_component(path ${file} ABSOLUTE)
    file(STRINGS ${path} torch_includes REGEX "^#include <torch/torch\\.h>")
    if(torch_includes)
      target_precompile_headers(${target} REUSE_FROM ddp_test_pch)
      # A header that does not fit the flags is read as text again, slowly: say so.
      target_compile_options(${target} PRIVATE -Winvalid-pch)
      return()
    endif()
  endforeach()
endfunction()
