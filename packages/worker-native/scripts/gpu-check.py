#!/usr/bin/env python3
"""GPU check of moeswarm-expert-worker: equivalence and speed of a GPU build against its own CPU
backend and an f64 oracle, with nothing but Python 3 + numpy and the pinned gguf-py (no Node: the
GPU machines we are lent have none).

  PYTHONPATH=<llama.cpp>/gguf-py python3 scripts/gpu-check.py --exe <moeswarm-expert-worker> \
      --device gpu --work /tmp/gc [--bench] [--json out.json]

For each weight type it writes a one-layer qwen3moe-shaped GGUF with gguf-py (random weights,
fixed seed), starts the worker on it twice (--device cpu and the device under test), sends the
same `dispatch` frames over stdio (docs/protocol.md; the tiny msgpack codec below is enough for
those frames) and compares:
  - cosine of every output slot against an f64 oracle computed from gguf-py's dequantisation
    (SwiGLU: down(silu(gate x) * up x));
  - the device's outputs against the CPU backend's (relative L2), and against the device's own
    monolithic graph (--reference: one mul_mat_id over the whole tensors, as llama.cpp runs it),
    which must be bit-identical;
  - "sum" mode against the f32 weighted sum of the "each" slots.
With --bench it times dispatches of 1..512 tokens on a bigger layer, device vs CPU (all cores),
from the `ms` field the worker reports (compute only) and the round trip through stdio.
Exits 1 if any check fails.

The participant's GPU backends (moeswarm-worker --backend vulkan; a CUDA machine the same way) run
moeswarm-expert-worker-llama on node-llama-cpp's published ggml build of the pinned commit; check
exactly that with --ggml-dir (the package's bins/<platform> directory, e.g. from
`npm pack @node-llama-cpp/linux-x64-cuda@3.21.1`):
  python3 scripts/gpu-check.py --exe prebuilds/linux-x64/moeswarm-expert-worker-llama \
      --ggml-dir <pkg>/bins/linux-x64-cuda --device CUDA0
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import quants

# --- msgpack, the subset our frames use ----------------------------------------------------------


def mp_pack(v, out: bytearray) -> None:
    if v is None:
        out.append(0xC0)
    elif v is True or v is False:
        out.append(0xC3 if v else 0xC2)
    elif isinstance(v, int):
        if v < 0:
            raise ValueError("negative ints are not used in our frames")
        if v < 0x80:
            out.append(v)
        elif v < 0x100:
            out += b"\xcc" + struct.pack(">B", v)
        elif v < 0x10000:
            out += b"\xcd" + struct.pack(">H", v)
        elif v < 0x100000000:
            out += b"\xce" + struct.pack(">I", v)
        else:
            out += b"\xcf" + struct.pack(">Q", v)
    elif isinstance(v, float):
        out += b"\xcb" + struct.pack(">d", v)
    elif isinstance(v, str):
        b = v.encode()
        if len(b) < 32:
            out.append(0xA0 | len(b))
        elif len(b) < 0x100:
            out += b"\xd9" + struct.pack(">B", len(b))
        else:
            out += b"\xda" + struct.pack(">H", len(b))
        out += b
    elif isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        if len(b) < 0x100:
            out += b"\xc4" + struct.pack(">B", len(b))
        elif len(b) < 0x10000:
            out += b"\xc5" + struct.pack(">H", len(b))
        else:
            out += b"\xc6" + struct.pack(">I", len(b))
        out += b
    elif isinstance(v, dict):
        if len(v) >= 16:
            raise ValueError("maps of 16+ keys are not used here")
        out.append(0x80 | len(v))
        for key, val in v.items():
            mp_pack(key, out)
            mp_pack(val, out)
    else:
        raise TypeError(type(v))


def _mp_count(b: bytes, i: int, c: int, fix_hi: int, c16: int) -> tuple[int, int]:
    """Element count and the offset after the header of a map (fix 0x80) or array (fix 0x90)."""
    if c <= fix_hi:
        return c & 0x0F, i + 1
    if c == c16:
        return struct.unpack_from(">H", b, i + 1)[0], i + 3
    return struct.unpack_from(">I", b, i + 1)[0], i + 5


def mp_unpack(b: bytes, i: int = 0):
    c = b[i]
    if c <= 0x7F:
        return c, i + 1
    if 0x80 <= c <= 0x8F or c in (0xDE, 0xDF):
        n, i = _mp_count(b, i, c, 0x8F, 0xDE)
        d = {}
        for _ in range(n):
            key, i = mp_unpack(b, i)
            d[key], i = mp_unpack(b, i)
        return d, i
    if 0x90 <= c <= 0x9F or c in (0xDC, 0xDD):
        n, i = _mp_count(b, i, c, 0x9F, 0xDC)
        a = []
        for _ in range(n):
            v, i = mp_unpack(b, i)
            a.append(v)
        return a, i
    if 0xA0 <= c <= 0xBF:
        n = c & 0x1F
        return b[i + 1 : i + 1 + n].decode(), i + 1 + n
    if c == 0xC0:
        return None, i + 1
    if c in (0xC2, 0xC3):
        return c == 0xC3, i + 1
    sizes = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
    if c in sizes:
        w = sizes[c]
        n = int.from_bytes(b[i + 1 : i + 1 + w], "big")
        s = b[i + 1 + w : i + 1 + w + n]
        return (s.decode() if c >= 0xD9 else s), i + 1 + w + n
    ints = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
    if c in ints:
        return struct.unpack_from(ints[c], b, i + 1)[0], i + 1 + struct.calcsize(ints[c])
    if c == 0xCA:
        return struct.unpack_from(">f", b, i + 1)[0], i + 5
    if c == 0xCB:
        return struct.unpack_from(">d", b, i + 1)[0], i + 9
    if c >= 0xE0:
        return c - 0x100, i + 1
    raise ValueError(f"msgpack byte 0x{c:02x} not handled")


# --- the worker over stdio -------------------------------------------------------------------------


# the environment of every worker: with --ggml-dir, node-llama-cpp's libraries (as the participant's
# llama-cpu and vulkan backends start moeswarm-expert-worker-llama)
WORKER_ENV = dict(os.environ)


class Worker:
    def __init__(self, exe: str, model: str, device: str, threads: int, reference: bool = False):
        args = [exe, "--slice", model, "--device", device, "--threads", str(threads)]
        if reference:
            args.append("--reference")
        self.p = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=WORKER_ENV
        )
        self.next_id = 1
        self.hello = self._read()
        self.register = self._read()
        if self.hello.get("t") != "hello" or self.register.get("t") != "register":
            raise RuntimeError(f"worker did not introduce itself: {self.hello} {self.register}")
        self.backend = self.register.get("backend")

    def _read(self) -> dict:
        head = self.p.stdout.read(4)
        if len(head) < 4:
            err = self.p.stderr.read().decode(errors="replace")
            raise RuntimeError(f"worker closed its stdout: {err}")
        n = int.from_bytes(head, "little")
        body = self.p.stdout.read(n)
        frame, _ = mp_unpack(body)
        return frame

    def dispatch(self, x: np.ndarray, ids: np.ndarray, w: np.ndarray, mode: str) -> tuple[np.ndarray, float]:
        n, embd = x.shape
        k = ids.shape[1]
        rid = self.next_id
        self.next_id += 1
        frame = {
            "t": "dispatch", "v": 1, "id": rid, "model": self.register["model"], "layer": 0, "n": n,
            "embd": embd, "dtype": "f32", "x": x.astype("<f4").tobytes(), "k": k,
            "ids": ids.astype("<i4").tobytes(), "w": w.astype("<f4").tobytes(), "mode": mode,
        }
        body = bytearray()
        mp_pack(frame, body)
        self.p.stdin.write(len(body).to_bytes(4, "little") + bytes(body))
        self.p.stdin.flush()
        r = self._read()
        if r.get("t") != "result" or r.get("id") != rid:
            raise RuntimeError(f"unexpected answer: { {k: v for k, v in r.items() if k != 'y'} }")
        y = np.frombuffer(r["y"], dtype="<f4")
        y = y.reshape(n, k, embd) if mode == "each" else y.reshape(n, embd)
        return y, float(r.get("ms", 0.0))

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=30)


# --- models and the oracle ---------------------------------------------------------------------------


def write_model(path: str, qtype: Q, n_embd: int, n_ff: int, n_expert: int, seed: int, oracle: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_name(f"gpu-check-{qtype.name.lower()}")
    w.add_expert_count(n_expert)
    w.add_expert_used_count(8)
    w.add_embedding_length(n_embd)
    w.add_expert_feed_forward_length(n_ff)
    dense = {}
    # numpy shape (expert, rows, cols) = ggml ne [cols, rows, expert]
    for name, shape, scale in (
        ("ffn_gate_exps", (n_expert, n_ff, n_embd), 1 / np.sqrt(n_embd)),
        ("ffn_up_exps", (n_expert, n_ff, n_embd), 1 / np.sqrt(n_embd)),
        ("ffn_down_exps", (n_expert, n_embd, n_ff), 1 / np.sqrt(n_ff)),
    ):
        a = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
        if qtype == Q.F32:
            data, stored = a, a
        elif qtype == Q.F16:
            data = a.astype(np.float16)
            stored = data.astype(np.float32)
        else:
            data = quants.quantize(a, qtype)
            stored = quants.dequantize(data, qtype).reshape(shape) if oracle else None
        w.add_tensor(f"blk.0.{name}.weight", data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        if oracle:
            dense[name] = stored.astype(np.float64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dense


def oracle_each(dense: dict, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    n, embd = x.shape
    k = ids.shape[1]
    out = np.zeros((n, k, embd))
    xd = x.astype(np.float64)
    for i in range(n):
        for j in range(k):
            e = ids[i, j]
            if e < 0:
                continue
            g = dense["ffn_gate_exps"][e] @ xd[i]
            u = dense["ffn_up_exps"][e] @ xd[i]
            h = g / (1 + np.exp(-g)) * u
            out[i, j] = dense["ffn_down_exps"][e] @ h
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b / (na * nb))


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def routing(rng, n: int, k: int, n_expert: int, empty: bool):
    ids = np.stack([rng.choice(n_expert, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    if empty and n > 1:
        ids[1, k - 1] = -1  # an empty slot: zeros in "each", skipped in "sum"
    w = rng.random((n, k), dtype=np.float32)
    w /= w.sum(axis=1, keepdims=True)
    return ids, w.astype(np.float32)


# --- checks ------------------------------------------------------------------------------------------------

# per-slot cosine bounds vs the f64 oracle, as in the CPU suite (test/equivalence). The GPU rounds
# activations to q8_1 (mmq) or keeps them f16/f32 (cuBLAS), the CPU to q8_0/q8_K
# (on this 512x256 layer the CPU's own Q8_0 gives 0.99988: hence 0.9998). Types not listed: 0.9995.
BOUNDS = {"F32": 0.99999, "F16": 0.9999, "BF16": 0.9999, "Q8_0": 0.9998, "Q4_0": 0.9998}


def read_model(path: str) -> tuple[str, dict]:
    """A model file written elsewhere (gpu-fixtures.mjs): its type and gguf-py's dequantisation."""
    r = gguf.GGUFReader(path)
    dense, qname = {}, None
    for t in r.tensors:
        if not t.name.startswith("blk.0.ffn_") or not t.name.endswith("_exps.weight"):
            continue
        ne = [int(v) for v in t.shape]  # ggml order: cols, rows, experts
        a = quants.dequantize(t.data, t.tensor_type).reshape(ne[2], ne[1], ne[0])
        dense[t.name.split(".")[2]] = a.astype(np.float64)
        qname = t.tensor_type.name
    return qname, dense


def check_type(args, name: str, report: dict, path: str | None = None) -> bool:
    if path is None:
        qtype = Q[name]
        path = os.path.join(args.work, f"check-{name.lower()}.gguf")
        dense = write_model(path, qtype, 512, 256, 16, seed=7 + int(qtype))
        owned = True
    else:
        name, dense = read_model(path)
        owned = False
    n_expert, _, n_embd = dense["ffn_gate_exps"].shape
    rng = np.random.default_rng(11)
    cpu = Worker(args.exe, path, "cpu", args.cpu_threads)
    dev = Worker(args.exe, path, args.device, args.cpu_threads)
    ref = Worker(args.exe, path, args.device, args.cpu_threads, reference=True)
    ok = True
    per_n: dict[int, float] = {}
    worst = {"cos_slot": 1.0, "cpu_cos_slot": 1.0, "ref_cos_slot": 1.0, "ref_rel_l2": 0.0, "dev_vs_cpu_rel_l2": 0.0, "ref_bit_identical": True, "sum_rel_l2": 0.0}
    try:
        for n in (1, 3, 8, 33, 128):
            x = rng.standard_normal((n, n_embd), dtype=np.float32)
            ids, w = routing(rng, n, 8, n_expert, empty=False)
            # the monolithic graph needs every slot filled; the device's own run gets one empty slot
            y_ref, _ = ref.dispatch(x, ids, w, "each")
            ids[min(1, n - 1), 7] = -1
            y_dev, _ = dev.dispatch(x, ids, w, "each")
            y_cpu, _ = cpu.dispatch(x, ids, w, "each")
            s_dev, _ = dev.dispatch(x, ids, w, "sum")
            o = oracle_each(dense, x, ids)
            for i in range(n):
                for j in range(8):
                    if ids[i, j] < 0:
                        if np.any(y_dev[i, j] != 0):
                            print(f"  {name}: empty slot ({i},{j}) is not zero")
                            ok = False
                        continue
                    worst["cos_slot"] = min(worst["cos_slot"], cosine(y_dev[i, j], o[i, j]))
                    worst["cpu_cos_slot"] = min(worst["cpu_cos_slot"], cosine(y_cpu[i, j], o[i, j]))
                    worst["ref_cos_slot"] = min(worst["ref_cos_slot"], cosine(y_ref[i, j], o[i, j]))
                    per_n[n] = min(per_n.get(n, 1.0), cosine(y_dev[i, j], o[i, j]))
            worst["dev_vs_cpu_rel_l2"] = max(worst["dev_vs_cpu_rel_l2"], rel_l2(y_dev, y_cpu))
            filled = (ids >= 0)[:, :, None]
            if not np.array_equal(np.where(filled, y_dev, 0), np.where(filled, y_ref, 0)):
                worst["ref_bit_identical"] = False
            worst["ref_rel_l2"] = max(worst["ref_rel_l2"], rel_l2(np.where(filled, y_dev, 0), np.where(filled, y_ref, 0)))
            # "sum" = sum_j w_j * y_j in f32, slot order (the worker's combine is not fused)
            s_expect = np.zeros((n, n_embd), dtype=np.float32)
            for j in range(8):
                s_expect += np.where(ids[:, j : j + 1] >= 0, w[:, j : j + 1] * y_dev[:, j], 0).astype(np.float32)
            worst["sum_rel_l2"] = max(worst["sum_rel_l2"], rel_l2(s_dev, s_expect))
    finally:
        for wk in (cpu, dev, ref):
            wk.close()
        if owned:
            os.unlink(path)
    # The device must be as close to the truth as the bound, or as ggml's own kernels are on the
    # same inputs: the CPU backend (K-quants: q8_K activation rounding) or the device's monolithic
    # mul_mat_id (llama.cpp's graph), with a little slack. On the CPU the slice path and the
    # monolithic graph are the same bits; a GPU's kernels depend on the batch's shape (mmvq for a
    # few rows per expert, mmq tiles for more, activations rounded to q8_1), so there the slice
    # path is held to the monolithic graph's accuracy instead of its bits.
    bound = min(BOUNDS.get(name, 0.9995), worst["cpu_cos_slot"] - 5e-5, worst["ref_cos_slot"] - 5e-5)
    exact = dev.backend == "cpu"
    if worst["cos_slot"] < bound or (exact and not worst["ref_bit_identical"]) or worst["sum_rel_l2"] > 1e-6:
        ok = False
    worst["min_cos_by_n"] = {str(n): c for n, c in per_n.items()}
    worst["bound"] = bound
    worst["backend"] = dev.backend
    worst["ok"] = ok
    report["checks"][name] = worst
    print(
        f"  {name:6} {dev.backend:6} min cos/slot {worst['cos_slot']:.6f} (cpu {worst['cpu_cos_slot']:.6f}, "
        f"monolithic {worst['ref_cos_slot']:.6f}, bound {bound:.6f}; by n {' '.join(f'{c:.5f}' for c in per_n.values())})  "
        f"vs cpu relL2 {worst['dev_vs_cpu_rel_l2']:.1e}  vs monolithic relL2 {worst['ref_rel_l2']:.1e} bits {worst['ref_bit_identical']}  "
        f"sum relL2 {worst['sum_rel_l2']:.1e}  {'ok' if ok else 'FAIL'}",
        flush=True,
    )
    return ok


def bench(args, report: dict) -> None:
    n_embd, n_ff, n_expert = args.bench_shape
    for qtype in (Q.Q8_0, Q.Q4_0):
        path = os.path.join(args.work, f"bench-{qtype.name.lower()}.gguf")
        t0 = time.time()
        write_model(path, qtype, n_embd, n_ff, n_expert, seed=3, oracle=False)
        size = os.path.getsize(path)
        print(f"  bench model {qtype.name} {n_embd}x{n_ff}x{n_expert} {size / 2**20:.0f} MiB written in {time.time() - t0:.1f} s", flush=True)
        rng = np.random.default_rng(5)
        rows = []
        workers = {"cpu": Worker(args.exe, path, "cpu", args.cpu_threads), "dev": Worker(args.exe, path, args.device, args.cpu_threads)}
        try:
            for n in (1, 8, 64, 512):
                x = rng.standard_normal((n, n_embd), dtype=np.float32)
                ids, w = routing(rng, n, 8, n_expert, empty=False)
                res = {}
                for key, wk in workers.items():
                    for _ in range(3):
                        wk.dispatch(x, ids, w, "sum")  # warm-up: graph build, first-touch
                    ms, rt = [], []
                    reps = 20 if n <= 64 else 8
                    for _ in range(reps):
                        t = time.perf_counter()
                        _, m = wk.dispatch(x, ids, w, "sum")
                        rt.append((time.perf_counter() - t) * 1e3)
                        ms.append(m)
                    res[key] = (float(np.median(ms)), float(np.median(rt)))
                row = {
                    "type": qtype.name, "n": n, "cpu_ms": res["cpu"][0], "dev_ms": res["dev"][0],
                    "cpu_rt_ms": res["cpu"][1], "dev_rt_ms": res["dev"][1],
                    "speedup_compute": res["cpu"][0] / max(res["dev"][0], 1e-9),
                    "dev_tok_s": n / (res["dev"][1] / 1e3), "cpu_tok_s": n / (res["cpu"][1] / 1e3),
                }
                rows.append(row)
                print(
                    f"  {qtype.name:5} n={n:4}  compute cpu {row['cpu_ms']:8.2f} ms  dev {row['dev_ms']:7.2f} ms  "
                    f"(x{row['speedup_compute']:.1f})  round trip cpu {row['cpu_rt_ms']:8.2f} dev {row['dev_rt_ms']:7.2f} ms  "
                    f"dev {row['dev_tok_s']:.0f} tok/s",
                    flush=True,
                )
        finally:
            for wk in workers.values():
                wk.close()
            os.unlink(path)
        report["bench"].extend(rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", required=True)
    ap.add_argument("--device", default="gpu")
    ap.add_argument("--work", default="/tmp/moeswarm-gpu-check")
    ap.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--types", default="F32,F16,BF16,Q8_0,Q4_0")
    ap.add_argument("--model-files", nargs="*", default=[], help="more one-layer models (scripts/gpu-fixtures.mjs)")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--bench-shape", default="2048,768,128", help="n_embd,n_ff,n_expert of the bench layer")
    ap.add_argument("--json")
    ap.add_argument("--ggml-dir", help="node-llama-cpp's bins/<platform> directory, for moeswarm-expert-worker-llama")
    args = ap.parse_args()
    if args.ggml_dir:
        ld = WORKER_ENV.get("LD_LIBRARY_PATH")
        WORKER_ENV["LD_LIBRARY_PATH"] = args.ggml_dir + (":" + ld if ld else "")
        WORKER_ENV["MOESWARM_GGML_BACKEND_DIR"] = args.ggml_dir
    args.bench_shape = tuple(int(v) for v in args.bench_shape.split(","))
    os.makedirs(args.work, exist_ok=True)
    version = subprocess.run([args.exe, "--version"], capture_output=True, text=True, env=WORKER_ENV).stdout.strip()
    print(version, flush=True)
    report = {"version": version, "device": args.device, "checks": {}, "bench": []}
    ok = True
    for name in args.types.split(","):
        ok = check_type(args, name, report) and ok
    for path in args.model_files:
        ok = check_type(args, "", report, path) and ok
    if args.bench:
        bench(args, report)
    report["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("gpu-check:", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
