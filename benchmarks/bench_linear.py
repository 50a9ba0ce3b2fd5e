"""float32 linear layers on the CPU: PyTorch's F.linear against oneDNN's matmul on the dense weight
and on a prepacked copy, and MKL's packed GEMM (kernels/packed_linear.py's formats, where this build
has them), per tokens per layer; what prepack.py chooses among.

A model's layer shapes (SmolLM2-135M's by default: 30 layers of q/k/v/o/gate/up/down and a 49152-row
head), distinct random weights so that they are read from memory as in a decode step, every way
timed interleaved, medians of --repeats; and a restricted draft head (--head rows) in bfloat16 (the
weight-only drafters' head), float32 and prepacked float32, with the cache flushed before each call.

    python benchmarks/bench_linear.py --tokens 1 2 4 8 16 24 --repeats 7 --head 8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import interleaved, machine
from hf_invisiblelora.kernels import packed_linear
from tiny import SMOLLM2_DIMS as SMOLLM2


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16, 24])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--head", type=int, default=8192, help="rows of the restricted draft head (0: skip)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    s = SMOLLM2
    shapes = [(s["hidden"], s["hidden"]), (s["kv"], s["hidden"]), (s["kv"], s["hidden"]), (s["hidden"], s["hidden"]),
              (s["intermediate"], s["hidden"]), (s["intermediate"], s["hidden"]), (s["hidden"], s["intermediate"])]
    weights = [torch.randn(n, k) * 0.02 for _ in range(s["layers"]) for n, k in shapes]
    weights.append(torch.randn(s["vocab"], s["hidden"]) * 0.02)
    packed = [packed_linear.pack(w) for w in weights]
    mkl = [packed_linear.pack(w, "mkl") for w in weights] if "mkl" in packed_linear.formats(torch.float32, "cpu") else None
    mb = sum(w.numel() * 4 for w in weights) / 1e6
    print(f"CPU {machine()}, {args.threads} threads; {len(weights)} layers, {mb:.0f} MB; ms per pass over all of "
          f"them, medians of {args.repeats}")
    print("| tokens | F.linear | oneDNN, dense weight | oneDNN, prepacked | MKL, prepacked |")
    print("|---|---|---|---|---|")
    for m in args.tokens:
        xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
        ways = {"linear": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
                "dense": lambda: [packed_linear.linear(xs[w.shape[1]], w, None) for w in weights],
                "packed": lambda: [packed_linear.linear(xs[w.shape[1]], pw, None) for w, pw in zip(weights, packed)]}
        if mkl is not None:
            ways["mkl"] = lambda: [packed_linear.linear(xs[w.shape[1]], pw, None) for w, pw in zip(weights, mkl)]
        t = {k: v * 1e3 for k, v in interleaved(ways, args.repeats)[0].items()}  # ms
        mkl_ms = f"{t['mkl']:.1f}" if mkl is not None else "-"
        print(f"| {m} | {t['linear']:.1f} | {t['dense']:.1f} | {t['packed']:.1f} | {mkl_ms} |", flush=True)
    if args.head:
        w = torch.randn(args.head, s["hidden"]) * 0.02
        wb, pw = w.to(torch.bfloat16), packed_linear.pack(w)
        flush = weights[: s["layers"]]
        print(f"\nA {args.head} x {s['hidden']} head, cache flushed before each call; ms")
        print("| rows | bfloat16 | float32 | float32 prepacked |")
        print("|---|---|---|---|")
        for m in (1, 4, 8):
            x = torch.randn(m, s["hidden"])
            ways = {"bf16": lambda: torch.nn.functional.linear(x.to(torch.bfloat16), wb).float(),
                    "fp32": lambda: torch.nn.functional.linear(x, w),
                    "packed": lambda: packed_linear.linear(x, pw, None)}
            flushed = interleaved(ways, args.repeats, before=lambda: [f.sum() for f in flush])[0]
            t = {k: v * 1e3 for k, v in flushed.items()}  # ms
            print(f"| {m} | {t['bf16']:.2f} | {t['fp32']:.2f} | {t['packed']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
