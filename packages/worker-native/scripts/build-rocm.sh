#!/bin/sh
# ROCm/HIP build of moeswarm-expert-worker (and the addon) from the pinned llama.cpp source: ggml's
# HIP backend (ggml/src/ggml-hip, which compiles ggml-cuda's kernels with ROCm's clang) next to the
# CPU one, through scripts/build-gpu.sh hip.
#
#   scripts/build-rocm.sh --check              says what this machine lacks; exit 0 when it can build
#   scripts/build-rocm.sh [cmake args...]      builds; e.g. -DAMDGPU_TARGETS=gfx90a (MI250),
#                                              gfx942 (MI300), gfx1100 (RX 7900)
#
# What the pinned ggml-hip needs (its CMakeLists.txt): CMake >= 3.21 with the HIP language,
# find_package(hip), find_package(hipblas), find_package(rocblas), and hip >= 6.1 (FATAL_ERROR
# below). Debian 12 has hipcc and libamdhip64-dev 5.2.3 and rocm-cmake 5.4.0, but no rocBLAS or
# hipBLAS package at all, so nothing installable from Debian 12 builds it: use AMD's ROCm >= 6.1
# repository (repo.radeon.com, `apt-get install rocm-hip-sdk hipblas-dev rocblas-dev`) or the
# rocm/dev-ubuntu-22.04:6.x container.
#
# On the ROCm machine, after building:
#   prebuilds/linux-x64-hip/moeswarm-expert-worker --version          # devices: ROCm0,CPU
#   python3 scripts/gpu-check.py --exe prebuilds/linux-x64-hip/moeswarm-expert-worker --device gpu
#   MOESWARM_NATIVE_ADDON=prebuilds/linux-x64-hip/node.napi.glibc.node and loadExpertCompute(path,
#     { backend: "native", device: "gpu" }) for the in-process addon
set -eu
cd "$(dirname "$0")/.."

missing=""
need() { missing="$missing
  - $1"; }

rocm=${ROCM_PATH:-/opt/rocm}
[ -d "$rocm" ] || rocm=/usr
if command -v hipconfig >/dev/null 2>&1; then
  version=$(hipconfig --version 2>/dev/null | sed 's/[^0-9.].*//')
  major=$(echo "$version" | cut -d. -f1)
  minor=$(echo "$version" | cut -d. -f2)
  if [ "${major:-0}" -lt 6 ] || { [ "${major:-0}" -eq 6 ] && [ "${minor:-0}" -lt 1 ]; }; then
    need "HIP >= 6.1 (hipconfig --version says ${version:-nothing}; ggml-hip stops with 'At least ROCM/HIP V6.1 is required')"
  fi
else
  need "hipconfig/hipcc (ROCm's HIP SDK, >= 6.1)"
fi
for pkg in hip hipblas rocblas; do
  found=""
  for d in "$rocm/lib/cmake/$pkg" "$rocm/lib64/cmake/$pkg" "/usr/lib/x86_64-linux-gnu/cmake/$pkg" "/usr/share/cmake/$pkg"; do
    [ -d "$d" ] && found=$d
  done
  [ -n "$found" ] || need "$pkg's CMake package (${pkg}-config.cmake; ggml-hip calls find_package($pkg REQUIRED))"
done
cmake_version=$(cmake --version 2>/dev/null | head -1 | sed 's/[^0-9]*//')
case "$cmake_version" in
  3.2[1-9]*|3.[3-9]*|[4-9]*) ;;
  *) need "CMake >= 3.21 (found ${cmake_version:-none})" ;;
esac

if [ -n "$missing" ]; then
  echo "build-rocm: this machine cannot build the pinned ggml-hip; missing:$missing" >&2
  exit 3
fi
[ "${1:-}" = "--check" ] && { echo "build-rocm: ready (HIP $version, $rocm)"; exit 0; }
exec sh scripts/build-gpu.sh hip "$@"
