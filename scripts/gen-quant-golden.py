#!/usr/bin/env python3
"""Writes crates/kernels/tests/data/quant_golden.json: random blocks of every GGUF block format
with their dequantized values computed by the `gguf` Python package (the reference dequantizers
that ship with the GGUF format), so the kernels' unpacking is checked against an independent
implementation.

Usage: python3 -m venv /tmp/v && /tmp/v/bin/pip install numpy gguf && /tmp/v/bin/python scripts/gen-quant-golden.py
"""
import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# type: (block bytes, [(offset of an f16 scale, magnitude)], f32 scale offset or None)
LAYOUTS = {
    "F16": (2, [], None),
    "BF16": (2, [], None),
    "Q4_0": (18, [(0, 0.01)], None),
    "Q4_1": (20, [(0, 0.01), (2, -0.05)], None),
    "Q5_0": (22, [(0, 0.01)], None),
    "Q5_1": (24, [(0, 0.01), (2, -0.05)], None),
    "Q8_0": (34, [(0, 0.01)], None),
    "Q2_K": (84, [(80, 0.01), (82, 0.005)], None),
    "Q3_K": (110, [(108, 0.01)], None),
    "Q4_K": (144, [(0, 0.01), (2, 0.005)], None),
    "Q5_K": (176, [(0, 0.01), (2, 0.005)], None),
    "Q6_K": (210, [(208, 0.01)], None),
    # Q8_K (d·q) has no dequantizer in the package; its unpacking is tested directly.
}
BLOCKS = 3

def main():
    rng = np.random.default_rng(20261129)
    out = {}
    for name, (block_bytes, f16_fields, f32_field) in LAYOUTS.items():
        qtype = getattr(T, name)
        if name in ("F16", "BF16"):
            values = rng.uniform(-1, 1, 64).astype(np.float32)
            if name == "F16":
                raw = values.astype(np.float16).tobytes()
            else:
                raw = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            raw = bytearray(rng.integers(0, 256, BLOCKS * block_bytes, dtype=np.uint8).tobytes())
            for b in range(BLOCKS):
                base = b * block_bytes
                for off, mag in f16_fields:
                    v = np.float16(mag * rng.uniform(0.5, 1.0))
                    raw[base + off:base + off + 2] = v.tobytes()
                if f32_field is not None:
                    v = np.float32(0.01 * rng.uniform(0.5, 1.0))
                    raw[base + f32_field:base + f32_field + 4] = v.tobytes()
            raw = bytes(raw)
        data = np.frombuffer(raw, dtype=np.uint8)
        deq = dequantize(data, qtype).astype(np.float32).reshape(-1)
        out[name] = {"bytes": raw.hex(), "values": [float(x) for x in deq]}
    path = os.path.join(os.path.dirname(__file__), "..", "crates", "kernels", "tests", "data", "quant_golden.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {path}", file=sys.stderr)

if __name__ == "__main__":
    main()
