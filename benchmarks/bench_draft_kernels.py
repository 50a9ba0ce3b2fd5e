"""What a cheaper draft pass could cost on this CPU: the linear layers of one SmolLM2-135M decoder
step (30 layers of q, k, v, o, gate, up, down, and the 49152-token head) at M rows, per weight
format, against fp32 ``F.linear``:

- bf16: weights and activations in bfloat16 (``F.linear``; what ``draft_dtype=torch.bfloat16`` runs);
- int8: weight-only int8 with per-channel scales (``torch._weight_int8pack_mm``, bf16 activations);
- int4: weight-only int4 in groups of 32 (``torch._weight_int4pack_mm_for_cpu``, bf16 activations).

Also "int4 fused": int4 with the layers that read one input fused into one kernel each (q, k, v;
gate, up), 4 matmuls a layer instead of 7: what a drafter that fused them would save.

Kernels differ by CPU (AVX2 only, AVX-512, AMX): measure on the machine at hand. Each repeat runs
every format once, in turn; medians of repeats; the ratio is to fp32 in the same repeat.

    python -P benchmarks/bench_draft_kernels.py --rows 1 4 8 16 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import machine, timed
from tiny import SMOLLM2_DIMS

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = (SMOLLM2_DIMS[k] for k in ("hidden", "intermediate", "kv", "layers", "vocab"))
# (out, in) of one decoder layer's linear layers, then the head.
LAYER = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
         (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
# The same layer with the matmuls that read one input fused: q|k|v, o, gate|up, down.
FUSED = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
GROUP = 32  # int4 quantization group


def formats(weight: torch.Tensor) -> dict:
    """{format: f(x fp32) -> y} for one weight [out, in] (fp32), each as its kernel needs it."""
    out = {"fp32": lambda x, w=weight: torch.nn.functional.linear(x, w)}
    bf16 = weight.to(torch.bfloat16)
    out["bf16"] = lambda x, w=bf16: torch.nn.functional.linear(x.to(torch.bfloat16), w)
    scale = weight.abs().amax(1).clamp(min=1e-8) / 127
    q8 = (weight / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
    s8 = scale.to(torch.bfloat16)
    out["int8"] = lambda x, w=q8, s=s8: torch._weight_int8pack_mm(x.to(torch.bfloat16), w, s)
    if weight.shape[1] % GROUP == 0:
        g = weight.reshape(weight.shape[0], -1, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo).clamp(min=1e-8) / 15)
        zeros = lo + scales * 8  # the kernel's zero point: value = (q - 8) * scale + zero
        q4 = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32).reshape(weight.shape)
        packed = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
        sz = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [in / G, out, 2]
        out["int4"] = lambda x, w=packed, sz=sz: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, GROUP, sz)
    return out


def check(fns: dict, weight: torch.Tensor) -> dict:
    """Each format's largest relative error against fp32 on random rows: the kernels are used as meant."""
    x = torch.randn(4, weight.shape[1])
    ref = fns["fp32"](x)
    return {name: float((fn(x).float() - ref).abs().max() / ref.abs().max()) for name, fn in fns.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/draft_kernels.json")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    shapes = LAYER * LAYERS + [(VOCAB, HIDDEN)]
    fused = FUSED * LAYERS + [(VOCAB, HIDDEN)]
    weights = {shape: torch.randn(*shape, generator=g) * 0.02 for shape in set(shapes) | set(fused)}
    fns = {shape: formats(w) for shape, w in weights.items()}
    errors = {name: max(check(fns[s], weights[s])[name] for s in weights) for name in fns[shapes[0]]}
    result = dict(machine=machine(), threads=torch.get_num_threads(), errors=errors, rows={})
    print(machine(), f"{torch.get_num_threads()} threads; largest relative error vs fp32:",
          {k: f"{v:.1e}" for k, v in errors.items()})
    for m in args.rows:
        x = torch.randn(m, HIDDEN, generator=g)
        xi = torch.randn(m, INTERMEDIATE, generator=g)
        names = list(fns[shapes[0]]) + ["int4 fused"]
        seconds = {name: [] for name in names}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name in names:
                kind, layers = ("int4", fused) if name == "int4 fused" else (name, shapes)
                with torch.no_grad():
                    t, _ = timed(lambda: [fns[s][kind](xi if s[1] == INTERMEDIATE else x) for s in layers], 1)
                seconds[name].append(t)
        seconds = {k: v[1:] for k, v in seconds.items()}
        row = {name: dict(ms=statistics.median(v) * 1e3,
                          ratio=statistics.median(a / b for a, b in zip(v, seconds["fp32"])))
               for name, v in seconds.items()}
        result["rows"][m] = row
        print(f"M={m:3d}: " + ", ".join(f"{k} {v['ms']:.2f} ms ({v['ratio']:.2f}x)" for k, v in row.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
