# A tied head's embedding rows gathered from its GEMV blocks (bf16) and AMX tiles (int8): the
# gather before (two bf16 / four int8 values a channel) and now (one int32), one process,
# 2 threads, medians of 11. As run:
#   PYTHONPATH=src .venv/bin/python results/embedding-gather-2026-12-07/run.py
import time

import torch

from tokenmill.kernels import amx_layout, gemv_layout

torch.set_num_threads(2)


def tm(f):
    f()
    ts = []
    for _ in range(11):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    return 1e3 * sorted(ts)[5]


def rows_before(packed, ids, k):
    flat = ids.reshape(-1)
    picked = packed[flat // 16, :, flat % 16]
    return picked.reshape(len(flat), -1)[:, :k]


def int8_before(tiles, ids, k):
    flat = ids.reshape(-1)
    picked = amx_layout._int8_lanes(tiles)[flat // 16, :, :, flat % 16]
    return picked.reshape(len(flat), -1)[:, :k]


for name, n, k in [("SmolLM2", 49152, 576), ("Gemma 3", 262144, 640)]:
    w = torch.randn(n, k).bfloat16()
    p = gemv_layout.pack(w)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    t = amx_layout.pack_int8(q)
    for T in (16, 1024, 2048):
        ids = torch.randint(0, n, (T,))
        assert torch.equal(gemv_layout.rows(p, ids, k), rows_before(p, ids, k))
        assert torch.equal(amx_layout.int8_rows(t, ids, k), int8_before(t, ids, k))
        print(
            f"{name} {T:5d} rows: bf16 blocks {tm(lambda: rows_before(p, ids, k)):.3f} -> "
            f"{tm(lambda: gemv_layout.rows(p, ids, k)):.3f} ms; int8 tiles "
            f"{tm(lambda: int8_before(t, ids, k)):.3f} -> {tm(lambda: amx_layout.int8_rows(t, ids, k)):.3f} ms"
        )
