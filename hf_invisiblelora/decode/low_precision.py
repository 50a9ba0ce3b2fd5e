"""The drafter's linear layers in a lower precision, and which precisions pay on this CPU.

``low_precision_linear(weight, bias, dtype)``: f(x) = x @ weight.T + bias with the weight in bfloat16
or float16 (activations cast at each layer), or weight-only int8 (per output channel) or int4 (per
group of 32 inputs; PyTorch's CPU kernels ``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``,
bfloat16 activations), which read 2x / 4x / 8x fewer weight bytes than float32. A layer whose shape
the int8 or int4 kernel does not take runs in bfloat16.

Which is faster depends on the CPU's kernels (benchmarks/bench_draft_kernels.py): ``draft_dtype="auto"``
(``draft_dtypes``, ``auto_dtypes``) installs the full model and those of AUTO whose one-token pass
is faster than full precision, as measured on the model's own layer shapes (tuning.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import tuning
from ..model.prepack import available_bytes
from ..model.quantized import plain
from ..model.walk import linears
from ..options import check_draft_dtype

INT4_GROUP = 32
# _weight_int8pack_mm takes in_features in multiples of this: torch 2.13 on the CPU segfaults for
# in_features 8, 24, 40 (or 4, 33) with more than one row (found by the architecture sweep:
# Gemma-3n's AltUp layers, 4 inputs); every multiple of 16 tried ran (16 to 576, 1 to 33 rows).
INT8_WIDTH = 16


# draft_dtype="auto" (the default) on the CPU: the full base model and those of its bfloat16, int8 and
# int4 copies whose matmuls are faster than full precision on this CPU (``auto_dtypes``: measured),
# the two fastest at most; the gate picks among them per cycle by measured cost and acceptance.
AUTO = (torch.bfloat16, torch.int8, torch.int4)
AUTO_KEEP = 2
SAMPLE = 4  # layers of a shape timed (their time scaled to the model's count of them)


def draft_dtypes(value, model, compiled: bool = False) -> tuple:
    """The drafters' dtypes for ``draft_dtype=value`` (options.check_draft_dtype) on ``model``: as
    given, each one the model's device has kernels for (the weight-only ones are PyTorch's CPU
    kernels); "auto": ``auto_dtypes``, or the model as it is for a call on ``compiled`` passes (which
    would compile a draft pass per drafter, and which warm_up builds for that drafter)."""
    choices = check_draft_dtype(value)
    if choices is None:
        return (None,) if compiled else auto_dtypes(model)
    for d in choices:
        if d in (torch.int8, torch.int4) and model.device.type != "cpu":
            raise ValueError(f"draft_dtype={d} uses PyTorch's CPU kernels; on {model.device.type} use torch.bfloat16.")
    return choices


def auto_dtypes(model) -> tuple:
    """The base model as it is (None), and on the CPU, where the model has float linear layers to copy
    (a quantized base drafts as it is), the dtypes of ``AUTO`` whose copies of them run a one-token
    pass faster than the layers as they are (tuning.py: measured on the model's own layer shapes,
    once per machine), the ``AUTO_KEEP`` fastest, if their copies fit in half the memory available."""
    if model.device.type != "cpu":
        return (None,)
    modules = [m for m in linears(model) if plain(m.weight) and m.weight.dtype.is_floating_point]
    if not modules:
        return (None,)
    groups = {}
    for m in modules:
        groups.setdefault((m.out_features, m.in_features, m.weight.dtype), []).append(m)
    faster = tuning.tuned("draft_dtype", sorted(f"{o}x{i}:{d}" for o, i, d in groups),
                          lambda: _faster_dtypes(groups))["faster"]
    dtypes = tuple(getattr(torch, name) for name in faster)
    size = {torch.bfloat16: 2, torch.float16: 2, torch.int8: 1, torch.int4: 0.5}
    copies = sum(m.weight.numel() for m in modules) * sum(size[d] for d in dtypes)
    room = available_bytes()
    if room is not None and 2 * copies > room:
        return (None,)
    return (None, *dtypes)


def _faster_dtypes(groups: dict) -> dict:
    """{"faster": the dtypes of AUTO whose one-token pass over the layers (SAMPLE of each shape, timed
    together, scaled to the model's count) takes at most tuning.MARGIN of the layers' own, fastest
    first, AUTO_KEEP at most; "ms": each one's estimated pass}."""
    with torch.no_grad():
        sample = {shape: layers[:SAMPLE] for shape, layers in groups.items()}
        xs = {shape: tuning.sample_input(1, shape[1], shape[2]) for shape in sample}
        ways = {"full": {shape: [(lambda x, m=m: nn.functional.linear(x, m.weight, m.bias)) for m in layers]
                         for shape, layers in sample.items()}}
        for d in AUTO:
            ways[str(d).removeprefix("torch.")] = {shape: [low_precision_linear(m.weight, m.bias, d) for m in layers]
                                                   for shape, layers in sample.items()}
        per_shape = {shape: tuning.fastest({name: (lambda fns=way[shape], x=xs[shape]: [f(x) for f in fns])
                                            for name, way in ways.items()}) for shape in sample}
    total = {name: sum(t[name] * len(groups[shape]) / len(sample[shape]) for shape, t in per_shape.items())
             for name in ways}
    faster = [n for n in total if n != "full" and tuning.pick({"full": total["full"], n: total[n]}, "full") == n]
    faster = sorted(faster, key=total.get)[:AUTO_KEEP]
    return {"faster": faster, "ms": {n: round(t * 1e3, 2) for n, t in total.items()}}


def low_precision_linear(weight: torch.Tensor, bias, dtype):
    """f(x) = x @ weight.T + bias with the weight in ``dtype`` (see the module docstring); the
    result in x's dtype. The derived weights are made here, once."""
    float_dtype = torch.bfloat16 if dtype in (torch.int8, torch.int4) else dtype  # of activations and bias
    bias = None if bias is None else bias.detach().to(float_dtype)
    out_features, in_features = weight.shape
    w = weight.detach().float()
    if dtype == torch.int4 and in_features % INT4_GROUP == 0 and out_features % 16 == 0:
        groups = w.reshape(out_features, -1, INT4_GROUP)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scales = (hi - lo).clamp_(min=1e-12).div_(15)
        # In place after the first: a first call makes these copies of every layer (half its extra time).
        q = (groups - lo[..., None]).div_(scales[..., None]).round_().clamp_(0, 15).to(torch.int32).reshape(w.shape)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel's dequantization: (q - 8) * scale + zero, so zero = lo + 8 * scale. [groups, out, 2]
        scale_zero = torch.stack([scales, lo + 8 * scales], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

        def int4(x):
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, in_features).to(torch.bfloat16), packed, INT4_GROUP,
                                                  scale_zero)
            return (y if bias is None else y + bias).reshape(*x.shape[:-1], out_features).to(x.dtype)
        return int4
    if dtype == torch.int8 and in_features % INT8_WIDTH == 0:
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        q = (w / scale[:, None]).round_().clamp_(-128, 127).to(torch.int8)
        scale = scale.to(torch.bfloat16)

        def int8(x):
            y = torch._weight_int8pack_mm(x.reshape(-1, in_features).to(torch.bfloat16), q, scale)
            return (y if bias is None else y + bias).reshape(*x.shape[:-1], out_features).to(x.dtype)
        return int8
    w = weight.detach().to(float_dtype)  # (a shape the int8 / int4 kernel does not take)
    return lambda x: nn.functional.linear(x.to(float_dtype), w, bias).to(x.dtype)
