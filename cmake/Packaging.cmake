# Debian packages: `cpack -G DEB` in a build configured with -DCMAKE_INSTALL_PREFIX=/usr
# (then GNUInstallDirs puts the library in Debian's multiarch lib/x86_64-linux-gnu) makes three
# packages, split the way Debian splits a library, one per install() component:
#   libddp      the shared library (component libddp)
#   libddp-dev  headers and the CMake package files: find_package(ddp) (component dev)
#   ddp-tools   ddprun, ddp-train, ddp-bench and their man pages (component tools)
# Run-time dependencies come from dpkg-shlibdeps (the libtorch, fmt, OpenSSL, ... packages the
# binaries link); libddp-dev depends on the -dev package its CMake files look for (LibTorch of the
# version built against). scripts/test-deb.sh installs them with apt into a clean Debian root.
#
# libddp.so carries no version in its SONAME (src/CMakeLists.txt sets none), so the runtime
# package is named libddp, after the SONAME as Debian names library packages, and holds
# libddp.so itself: it is the file the programs load.
set(CPACK_PACKAGE_NAME ddp)
set(CPACK_PACKAGE_VENDOR "ddp-cpp")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "data-parallel training for C++ on LibTorch")
set(DDP_DEB_MAINTAINER "ddp-cpp maintainers <ddp-cpp@invalid>"
    CACHE STRING "Maintainer field of the Debian packages")
set(CPACK_PACKAGE_CONTACT ${DDP_DEB_MAINTAINER})
set(CPACK_STRIP_FILES ON)

if(NOT CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  # The packages install under /usr whatever the prefix; only the library folder differs.
  message(STATUS "ddp: cpack -G DEB wants -DCMAKE_INSTALL_PREFIX=/usr (Debian's library folder "
                 "lib/<multiarch>); with ${CMAKE_INSTALL_PREFIX} libddp goes to /usr/${CMAKE_INSTALL_LIBDIR}")
endif()

# Installed into a folder the loader searches anyway (/usr/lib/x86_64-linux-gnu with the /usr
# prefix), the programs need no $ORIGIN RPATH to find libddp.so (CMakeLists.txt sets one for
# other prefixes); Debian's policy asks for none (lintian: custom-library-search-path).
if(CMAKE_INSTALL_FULL_LIBDIR IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES)
  set_target_properties(ddp ddprun ddp-train ddp-bench PROPERTIES INSTALL_RPATH "")
endif()

set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL libddp dev tools)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # <package>_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)

# dpkg-shlibdeps turns each binary's NEEDED libraries into the packages that ship them.
# libddp.so is ours, not in any installed package: shlibdeps finds it in the build tree and
# leaves it out, and the packages depend on libddp of this exact version explicitly.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
get_target_property(_ddp_lib_dir ddp BINARY_DIR)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${_ddp_lib_dir})
set(_ddp_self "libddp (= ${CPACK_PACKAGE_VERSION})")

# The headers are LibTorch's of this minor version (1.13.x here; its C++ API and ABI change
# between minors): ddpConfig.cmake finds Torch, and libddp.so links that libtorch.
string(REGEX MATCH "^[0-9]+\\.[0-9]+" _torch_minor "${Torch_VERSION}")
set(_torch_pkg libtorch-dev)
if(DDP_WITH_NCCL)
  set(_torch_pkg libtorch-cuda-dev)
endif()
if(_torch_minor)
  string(REGEX MATCH "^[0-9]+" _torch_major "${_torch_minor}")
  string(REGEX REPLACE "^[0-9]+\\." "" _torch_next "${_torch_minor}")
  math(EXPR _torch_next "${_torch_next} + 1")
  set(_torch_dev "${_torch_pkg} (>= ${_torch_minor}), ${_torch_pkg} (<< ${_torch_major}.${_torch_next})")
else()  # a LibTorch without a version file (not Debian's): the packages are not for Debian then
  message(STATUS "ddp packaging: LibTorch's version is unknown; libddp-dev depends on any ${_torch_pkg}")
  set(_torch_dev "${_torch_pkg}")
endif()

set(CPACK_DEBIAN_LIBDDP_PACKAGE_NAME libddp)
set(CPACK_DEBIAN_LIBDDP_PACKAGE_SECTION libs)
string(CONCAT CPACK_COMPONENT_LIBDDP_DESCRIPTION
  "data-parallel training for C++ on LibTorch (shared library)\n"
  "DistributedDataParallel, process groups over shared memory, Gloo or NCCL, a rendezvous\n"
  "store and a distributed sampler, for C++ programs using LibTorch.")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libddp-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "${_ddp_self}, ${_torch_dev}")
string(CONCAT CPACK_COMPONENT_DEV_DESCRIPTION
  "data-parallel training for C++ on LibTorch (development files)\n"
  "Headers and CMake package files: find_package(ddp) and target_link_libraries(app ddp::ddp).")

set(CPACK_DEBIAN_TOOLS_PACKAGE_NAME ddp-tools)
set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION science)
set(CPACK_DEBIAN_TOOLS_PACKAGE_DEPENDS "${_ddp_self}")
# ddp-train reads Debian's Fashion-MNIST by default and plots with gnuplot (a note when it is
# missing); LibTorch is slow on the reference BLAS (docs/performance.md: BLAS).
set(CPACK_DEBIAN_TOOLS_PACKAGE_RECOMMENDS
    "dataset-fashion-mnist, gnuplot-nox | gnuplot, libopenblas0-pthread | libopenblas0")
set(CPACK_DEBIAN_TOOLS_PACKAGE_SUGGESTS "python3")  # ddprun runs PROGRAM.py with python3
string(CONCAT CPACK_COMPONENT_TOOLS_DESCRIPTION
  "data-parallel training for C++ on LibTorch (tools)\n"
  "ddprun, a torchrun-compatible launcher; ddp-train, Fashion-MNIST across processes with\n"
  "checkpoints and exact resume; ddp-bench, collectives and training throughput.")

# A static libddp (BUILD_SHARED_LIBS=OFF): no libddp package; the tools carry the library, and
# whoever links libddp.a needs its private dependencies too (ddpConfig.cmake.in).
if(NOT BUILD_SHARED_LIBS)
  set(CPACK_COMPONENTS_ALL dev tools)
  set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
      "${_torch_dev}, libfmt-dev, zlib1g-dev, libssl-dev, nlohmann-json3-dev")
  unset(CPACK_DEBIAN_TOOLS_PACKAGE_DEPENDS)
endif()

include(CPack)
