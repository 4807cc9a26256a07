# Cross toolchain for the aarch64 builds (Debian: apt-get install g++-aarch64-linux-gnu).
# The executable is linked with -static (MOESWARM_STATIC), so the same ELF runs on Android
# and on any aarch64 Linux; the addon (linux-arm64) links the toolchain's glibc dynamically.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(MOESWARM_CROSS_PREFIX "aarch64-linux-gnu-" CACHE STRING "prefix of the cross compilers")
set(CMAKE_C_COMPILER   ${MOESWARM_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${MOESWARM_CROSS_PREFIX}g++)

set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
