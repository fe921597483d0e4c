"""What creating a TMA descriptor inside a kernel costs (tl.make_tensor_descriptor: the tensormap is
written to global scratch and fenced before use), against one descriptor made once on the host and
passed as an argument (triton.tools.tensor_descriptor.TensorDescriptor).

One program an SM on 8 warps (the attention kernels run one 8-warp program an SM) runs "walks" one
after another, each reading WALK [64, 128] bf16 tiles through four descriptors: made on the device at
the walk's start ("device", as the kernels do per program and head) or on the host ("host"). The
difference per walk is what four device-side creations cost a program, exposed.

    python benchmarks/desc_cost_probe.py --out $OUT/desc-cost.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from sparse_attn.bench.results import make_header
from sparse_attn.ops.block_sparse.launch import _ensure_allocator


@triton.jit
def _walks(P, OUT, h0, h1, h2, h3, rows, n_walks, WALK: tl.constexpr, MODE: tl.constexpr):
    """One program an SM (grid = SM count) runs walks pid, pid + grid, ...: each walk makes four
    descriptors (MODE 0: on the device, as the attention kernels do per program and head; MODE 1:
    takes the host's h0-h3) and reads WALK [64, 128] tiles through them, four a step."""
    pid = tl.program_id(0)
    acc = tl.zeros([64, 128], tl.float32)
    n_tiles = rows // 64
    for w in range(pid, n_walks, tl.num_programs(0)):
        if MODE == 0:
            d0 = tl.make_tensor_descriptor(P, shape=[rows, 128], strides=[128, 1], block_shape=[64, 128])
            d1 = tl.make_tensor_descriptor(P, shape=[rows, 128], strides=[128, 1], block_shape=[64, 128])
            d2 = tl.make_tensor_descriptor(P, shape=[rows, 128], strides=[128, 1], block_shape=[64, 128])
            d3 = tl.make_tensor_descriptor(P, shape=[rows, 128], strides=[128, 1], block_shape=[64, 128])
        else:
            d0, d1, d2, d3 = h0, h1, h2, h3
        for i in tl.range(0, WALK // 4, num_stages=3):
            row = ((w * WALK + 4 * i) % n_tiles) * 64
            acc += d0.load([row, 0]).to(tl.float32) + d1.load([(row + 64) % rows, 0]).to(tl.float32)
            acc += d2.load([(row + 128) % rows, 0]).to(tl.float32) + d3.load([(row + 192) % rows, 0]).to(tl.float32)
    o = tl.arange(0, 64)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(OUT + pid.to(tl.int64) * 64 * 128 + o, acc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--walks", type=int, default=4096, help="walks (programs of the attention kernels)")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--walk-lengths", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    _ensure_allocator()  # the kernels' scratch for device-made descriptors
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    p = torch.randn(a.rows, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n_sm, 64, 128, device="cuda", dtype=torch.float32)
    hosts = [TensorDescriptor.from_tensor(p, [64, 128]) for _ in range(4)]
    modes = {"device": 0, "host": 1}
    rows = []
    for walk in a.walk_lengths:
        def call(mode, walk=walk):
            _walks[(n_sm,)](p, out, *hosts, a.rows, a.walks, WALK=walk, MODE=mode, num_warps=8)
        ref = None
        for mode in modes.values():  # compile, and check both read the same tiles
            out.fill_(float("nan"))
            call(mode)
            ref = out.clone() if ref is None else ref
            assert torch.equal(out, ref), (mode, walk)
        times = {name: [] for name in modes}
        for _ in range(a.rounds):  # alternated; medians of do_bench's medians
            for name, mode in modes.items():
                times[name].append(triton.testing.do_bench(lambda mode=mode: call(mode), return_mode="median"))
        med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        walks_per_sm = a.walks / n_sm
        row = dict(walk_tiles=walk, walks=a.walks, sms=n_sm, ms=med,
                   four_creations_per_walk_us=(med["device"] - med["host"]) * 1e3 / walks_per_sm)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        header = make_header("cuda", "probe", script="benchmarks/desc_cost_probe.py")
        Path(a.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
