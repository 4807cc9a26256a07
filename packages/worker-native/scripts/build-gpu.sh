#!/bin/sh
# GPU builds of the addon and moeswarm-expert-worker from the same CMake tree, with ggml's CUDA or
# HIP backend in addition to the CPU one. Not part of `pnpm build`: Debian has neither the CUDA
# toolkit nor ROCm's hipBLAS, so CI cannot build these.
#
#   scripts/build-gpu.sh cuda [extra cmake args]    needs the CUDA toolkit (nvcc, cuBLAS), 12.x or 13.x;
#                                                   e.g. -DCMAKE_CUDA_ARCHITECTURES="80;90"
#   scripts/build-gpu.sh hip  [extra cmake args]    needs ROCm 6.x (hipcc/clang, hipBLAS, rocBLAS);
#                                                   e.g. -DAMDGPU_TARGETS=gfx1100
#
# Outputs go to prebuilds/linux-x64-<kind>/ (a directory node-gyp-build never picks by itself).
# Use them with:
#   MOESWARM_NATIVE_ADDON=prebuilds/linux-x64-cuda/node.napi.glibc.node  + loadExpertCompute(path, { device: "gpu" })
#   prebuilds/linux-x64-cuda/moeswarm-expert-worker --slice s.gguf --device gpu
# Both link the toolkit's shared libraries (libcudart, libcublas / libamdhip64, libhipblas): the
# machine that runs them needs the same runtime.
set -eu
cd "$(dirname "$0")/.."

kind=${1:-}
[ -n "$kind" ] && shift
case "$kind" in
  cuda)
    command -v nvcc >/dev/null 2>&1 || { echo "build-gpu: nvcc not found (install the CUDA toolkit)" >&2; exit 1; }
    backend="-DGGML_CUDA=ON"
    ;;
  hip)
    command -v hipconfig >/dev/null 2>&1 || { echo "build-gpu: hipconfig not found (install ROCm)" >&2; exit 1; }
    # ggml's HIP build compiles with ROCm's clang
    export HIPCXX="${HIPCXX:-$(hipconfig -l)/clang}"
    export HIP_PATH="${HIP_PATH:-$(hipconfig -R)}"
    backend="-DGGML_HIP=ON"
    ;;
  *)
    echo "usage: scripts/build-gpu.sh cuda|hip [cmake args...]" >&2
    exit 2
    ;;
esac

# MOESWARM_LLAMA_SRC: an extracted copy of the pinned source, for machines without Node (the
# GPU check in scripts/gpu-check.py needs only the executable); the addon needs Node's cmake-js
src=${MOESWARM_LLAMA_SRC:-$(node ../../tools/llama-source.mjs)}
inc=""
if command -v node >/dev/null 2>&1 && [ -x node_modules/.bin/cmake-js ]; then
  inc=$(node_modules/.bin/cmake-js print-cmakejs-include 2>/dev/null | grep node-api-headers || true)
fi
dir=build/linux-x64-$kind
generator=""
command -v ninja >/dev/null 2>&1 && generator="-G Ninja"

# shellcheck disable=SC2086
cmake -S . -B "$dir" $generator \
  -DMOESWARM_LLAMA_SRC="$src" -DCMAKE_BUILD_TYPE=Release -DCMAKE_JS_INC="$inc" \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
  $backend "$@"
cmake --build "$dir" --parallel "$(nproc)"

out=prebuilds/linux-x64-$kind
mkdir -p "$out"
if [ -f "$dir/bin/moeswarm_expert.node" ]; then
  cp "$dir/bin/moeswarm_expert.node" "$out/node.napi.glibc.node"
else
  echo "build-gpu: no Node/cmake-js here, so the executable only (no addon)"
fi
cp "$dir/bin/moeswarm-expert-worker" "$out/moeswarm-expert-worker"
echo "build-gpu: $out/ ($("$out/moeswarm-expert-worker" --version))"
