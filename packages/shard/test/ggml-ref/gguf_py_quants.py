# Runs gguf-py's numpy reference (gguf/quants.py of the pinned llama.cpp release) over a batch of
# jobs framed on stdin, each: u32 op (0 dequantize, 1 quantize), u32 name length, type name,
# u32 element count, u32 payload length, payload (blocks, or f32 LE values). Answers each job on
# stdout as u32 status (0 ok, 1 not implemented), u32 length, payload (f32 LE values, or blocks).
import struct
import sys

import numpy as np
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize

inp = sys.stdin.buffer
out = sys.stdout.buffer


def read(n):
    b = inp.read(n)
    if len(b) != n:
        raise EOFError
    return b


while True:
    try:
        (op,) = struct.unpack("<I", read(4))
    except EOFError:
        break
    (name_len,) = struct.unpack("<I", read(4))
    qtype = GGMLQuantizationType[read(name_len).decode()]
    n, size = struct.unpack("<II", read(8))
    payload = read(size)
    try:
        if op == 0:
            res = dequantize(np.frombuffer(payload, dtype=np.uint8), qtype).astype("<f4").reshape(-1).tobytes()
            assert len(res) == 4 * n
        else:
            values = np.frombuffer(payload, dtype="<f4").reshape(1, n)
            res = np.ascontiguousarray(quantize(values, qtype)).view(np.uint8).reshape(-1).tobytes()
        out.write(struct.pack("<II", 0, len(res)) + res)
    except NotImplementedError:
        out.write(struct.pack("<II", 1, 0))
out.flush()
