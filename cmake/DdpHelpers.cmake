# ddp_add_test(NAME <name> SOURCES <files...> LABEL unit|collective|multiproc
#              [LIBS <targets...>] [TIMEOUT <s>] [ENV <VAR=value...>]
#              [FAULT <gtest filter> [FAULT_TIMEOUT <s>]] [EACH_CASE])
#
# One executable per test file. Every test gets a ctest TIMEOUT, the outer deadline that turns
# a hang into a failure instead of a stuck CI run.
#
# FAULT "Suite.Test*:Suite2.*" (a gtest filter) splits the executable in two ctest entries: NAME
# runs every other test, NAME.fault runs those, labelled LABEL and `fault` (the fault-injection
# suite: `ctest -L fault`), under FAULT_TIMEOUT (default TIMEOUT). A test that is all faults
# takes `set_property(TEST NAME APPEND PROPERTY LABELS fault)` instead.
#
# EACH_CASE: one ctest entry per TEST(Suite, Case) of the sources, NAME.Case, so that a case
# that crashes the process is named and the others still run (the GPU tests: one run on a lent
# machine must report every case). The entries' names are left in NAME_TESTS.
function(ddp_add_test)
  cmake_parse_arguments(T "EACH_CASE" "NAME;LABEL;TIMEOUT;FAULT;FAULT_TIMEOUT" "SOURCES;LIBS;ENV" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  if(NOT T_FAULT_TIMEOUT)
    set(T_FAULT_TIMEOUT ${T_TIMEOUT})
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE GTest::gtest GTest::gtest_main fmt::fmt ${T_LIBS})
  # Test files are compiled for build speed: see DDP_TEST_OPTIMIZE.
  if(DDP_TEST_OPTIMIZE)
    target_compile_options(${T_NAME} PRIVATE ${DDP_TEST_OPTIMIZE})
  endif()
  # Tests may reach internals (src/) to test pure logic alone.
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/src)
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
    set_tests_properties(${tests} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
                         ENVIRONMENT "${environment}")
    set(${T_NAME}_TESTS ${tests} PARENT_SCOPE)
    return()
  else()
    add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  endif()
  set_tests_properties(${T_NAME} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "${environment}")
endfunction()
