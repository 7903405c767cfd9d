# ddp_add_test(NAME <name> SOURCES <files...> LABEL unit|collective|multiproc
#              [LIBS <targets...>] [TIMEOUT <s>] [ENV <VAR=value...>])
#
# One executable per test file. Every test gets a ctest TIMEOUT, the outer deadline that turns
# a hang into a failure instead of a stuck CI run.
function(ddp_add_test)
  cmake_parse_arguments(T "" "NAME;LABEL;TIMEOUT" "SOURCES;LIBS;ENV" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE GTest::gtest GTest::gtest_main fmt::fmt ${T_LIBS})
  # Tests may reach internals (src/) to test pure logic alone.
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/src)
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  set_tests_properties(${T_NAME} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "DDP_BUILD_DIR=${PROJECT_BINARY_DIR};${T_ENV}")
endfunction()
