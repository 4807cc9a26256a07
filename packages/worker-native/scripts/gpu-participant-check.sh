#!/bin/sh
# The participant's "cuda" backend on a lent GPU machine, as ONE prepared run (< 10 min on an H200):
# moeswarm-expert-worker-llama on node-llama-cpp's CUDA build of the pinned commit (exactly what
# `moeswarm-worker --backend cuda` spawns: LD_LIBRARY_PATH and MOESWARM_GGML_BACKEND_DIR = the
# package's bins, --device CUDA0), checked by scripts/gpu-check.py against the f64 oracle and the
# CPU backend of the same build, per type, plus the participant's own probe when Node is there.
#
#   sh scripts/gpu-participant-check.sh --bins DIR [--out DIR] [--device CUDA0|cpu] [--bench]
#
# DIR is @node-llama-cpp/linux-x64-cuda@3.21.1's bins/linux-x64-cuda (143 MB packed; the GPU
# machine reaches no registry, so it travels with the session: see "carry" below). `--device cpu`
# is the dry run: everything but the GPU, on this build's own CPU backend (what CI-less machines
# and this script's test can run). Writes $OUT/summary.txt, $OUT/gpu-check.json, $OUT/probe.json.
#
# Carry (the device tool moves at most 64 MiB per call; libggml-cuda.so alone is 159 MB, 124 MB
# with zstd -19): split the compressed bins into ignored files here,
#   mkdir -p .cache/gpu-carry && tar c -C <pkg> bins/linux-x64-cuda | zstd -19 --long=27 -T2 |
#     split -b 55m - .cache/gpu-carry/part-          # part-aa, part-ab, part-ac
# carry one part per call while the machine stays warm (ignored paths already there are kept between
# calls): `true` with carry [.cache/gpu-carry/part-aa], then -ab, then the last call runs
#   sh packages/worker-native/scripts/gpu-participant-check.sh --assemble .cache/gpu-carry --out $OUT
# with carry [.cache/gpu-carry/part-ac, .cache/gpu-carry/gguf-py (a copy, not the .cache symlink),
# packages/worker-native/prebuilds/linux-x64]; --assemble joins and unpacks them (zstd --long=27 -d).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
pkg=$(cd "$here/.." && pwd)
root=$(cd "$pkg/../.." && pwd)
bins=""
out="${OUT:-/tmp/moeswarm-gpu-participant}"
device="CUDA0"
bench=""
assemble=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bins) bins="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --bench) bench="--bench"; shift ;;
    --assemble) assemble="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
t0=$(date +%s)

if [ -n "$assemble" ]; then
  command -v zstd >/dev/null 2>&1 || { say "FAIL --assemble needs zstd on this machine"; exit 1; }
  # part-aa, part-ab...: one zstd stream of a tar of bins/linux-x64-cuda
  cat "$assemble"/part-* | zstd -d -q --long=27 | tar x -C "$assemble"
  bins="$assemble/bins/linux-x64-cuda"
fi
[ -n "$bins" ] || { echo "--bins DIR (or --assemble DIR) is required" >&2; exit 2; }
[ -f "$bins/libggml-cuda.so" ] && [ -f "$bins/libggml-base.so" ] || {
  say "FAIL $bins lacks libggml-cuda.so / libggml-base.so (npm pack @node-llama-cpp/linux-x64-cuda@3.21.1)"
  exit 1
}
# the executable has no run path: node-llama-cpp's GPU packages name their ggml libggml.cuda.v*.so,
# so libggml.v*.so comes from the CPU package (after the GPU directory gpu-check.py puts first)
if ! ls "$bins"/libggml.v*.so >/dev/null 2>&1; then
  cpu_bins=$(ls -d "$root"/node_modules/.pnpm/@node-llama-cpp+linux-x64@*/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64 2>/dev/null | head -1)
  [ -n "$cpu_bins" ] || { say "FAIL no @node-llama-cpp/linux-x64 (its libggml.v*.so) under $root/node_modules"; exit 1; }
  export LD_LIBRARY_PATH="$cpu_bins${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
exe="$pkg/prebuilds/linux-x64/moeswarm-expert-worker-llama"
[ -x "$exe" ] || { say "FAIL $exe is not built (MOESWARM_NATIVE_TARGETS=linux-x64 build of worker-native)"; exit 1; }

if [ "$device" != "cpu" ]; then
  say "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
fi
# the participant's own probe (dist/ of this package), when the machine has Node 20+
if command -v node >/dev/null 2>&1 && [ -f "$pkg/dist/index.js" ]; then
  MOESWARM_GGML_CUDA_DIR="$bins" timeout 120 node --input-type=module -e '
    const m = await import(process.argv[1]);
    try { const s = await m.probeCuda(); console.log(JSON.stringify({ ok: true, ...s })); }
    catch (e) { console.log(JSON.stringify({ ok: false, code: e.code, message: e.message })); }
  ' "$pkg/dist/index.js" >"$out/probe.json" 2>>"$out/probe.stderr" || true
  say "probe: $(cat "$out/probe.json")"
else
  say "probe: skipped (no node or no dist/ here)"
fi

gguf_py=""
for d in ${GGUF_PY:-} ${assemble:+"$assemble/gguf-py"} "$root"/.cache/llama.cpp-*/gguf-py "$root"/vendor/llama.cpp/gguf-py; do
  [ -d "$d" ] && gguf_py="$d" && break
done
[ -n "$gguf_py" ] || { say "FAIL no gguf-py (the pinned llama.cpp source under .cache/)"; exit 1; }
fx="$out/fixtures"
if command -v node >/dev/null 2>&1; then
  node "$here/gpu-fixtures.mjs" "$fx" >/dev/null 2>&1 || true
fi
more=""
[ -f "$fx/check-q4_k.gguf" ] && more="--model-files $fx/check-q4_k.gguf"
set +e
PYTHONPATH="$gguf_py" timeout 480 python3 "$here/gpu-check.py" --exe "$exe" --ggml-dir "$bins" \
  --device "$device" --types F32,F16,BF16,Q8_0,Q4_0 $more --work "$out/work" \
  --json "$out/gpu-check.json" $bench >"$out/gpu-check.log" 2>&1
rc=$?
set -e
tail -n 25 "$out/gpu-check.log" | tee -a "$summary"
say "gpu-check exit $rc ($(($(date +%s) - t0)) s in all)"
exit $rc
