"""The model's float32 linear layers with prepacked weights in our passes (the CPU).

    packed = PackedLinears(peft_model, state, "auto", check)  # once per call: the copies checked or made
    with packed.installed(context): ...                # our passes run them (the pass context, context.py)

Every plain ``nn.Linear`` with a plain float32 weight on the CPU (the base layers under PEFT's
LoRA wrappers, the layers no adapter targets, the output head; not the adapters' own lora_A /
lora_B, which the bank reads from its stacks; quantized layers compute as they are: quantized.py)
can get a copy of its weight in oneDNN's layout (kernels/packed_linear.py), kept in the model state
while the weight is unchanged; our passes (prefill, LoRA-on, draft, verify) run it, anything else
(another thread, a user's processor calling the model) gets the layers as they are. A drafter's
low-precision layers take the place of these in its passes.

Whether the copy is faster than PyTorch's own ``F.linear`` depends on the CPU and on the tokens a
pass gives the layer: on an AVX2 EPYC it was up to 2x faster at every count, on a Xeon with AMX
2-3x slower at 1-2 tokens and faster from 4. So ``prepack="auto"`` measures both on the model's own
layers, per weight shape and token count (``thresholds``; tuning.py: once per machine, cached), and
a layer runs its copy only from the token count where the copy is faster, ``F.linear`` below it;
layers whose copy is never faster get none. The copies cost the weights' size again in memory:
"auto" makes none unless they fit in half the memory available. ``True``: every layer, every token
count; ``False``: none. The output is the model's up to
float32 rounding (another kernel: another order of summation, as a batch of another size is for
MKL), so greedy tokens can differ from stock's only at near ties of its logits.

A copy is used only while its weight is provably the one it was made from (derived.py: every
route of change is seen).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
from torch import nn

from .. import tuning
from ..kernels import packed_linear
from .context import on_real, real_tokens
from .derived import DerivedCopies, SourceCheck
from .quantized import plain
from .routing import ALL
from .walk import linears

logger = logging.getLogger("hf_invisiblelora")
# Tokens per layer at which "auto" times both matmuls; past the last, its verdict holds.
TOKENS = (1, 2, 3, 4, 6, 8, 16, 32)
SAMPLE_EVERY = 3  # the layers timed: every third in the model's order
NEVER = 1 << 62


def _eligible(m) -> bool:
    """A plain Linear whose forward is only F.linear of its weight: not routed by anyone else (an
    accelerate hook sets ``forward``), no pre-hook that recomputes its weight (pruning), a plain
    float weight (a quantized one, a torchao tensor subclass, computes its own linear)."""
    w = getattr(m, "weight", None)
    return type(m) is nn.Linear and plain(w) and w.dim() == 2 \
        and packed_linear.available(w.dtype, w.device) and "forward" not in m.__dict__ and not m._forward_pre_hooks


def available_bytes() -> int | None:
    """The memory the OS says is available (MemAvailable), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _shape(m) -> str:
    return f"{m.out_features}x{m.in_features}"


def thresholds(modules) -> dict:
    """{weight shape "out x in": the fewest tokens from which the prepacked copy is faster than
    F.linear at every count of TOKENS (NEVER: at none)}, timed on a sample of the layers in the
    model's order (every layer of SAMPLE_EVERY, so that the weights stream through the caches as in a
    pass; each call timed, summed per shape, the fastest of the repeats; tuning.py: once per machine,
    the reference F.linear)."""
    shapes = sorted({_shape(m) for m in modules})
    sample = modules[::SAMPLE_EVERY] + [m for m in modules[-1:] if m not in modules[::SAMPLE_EVERY]]
    sample += [next(m for m in modules if _shape(m) == shape) for shape in shapes
               if all(_shape(m) != shape for m in sample)]  # every shape at least once

    def measure():
        with torch.no_grad():
            packed = {m: packed_linear.pack(m.weight) for m in sample}
            ways = {"plain": lambda m, x: nn.functional.linear(x, m.weight, m.bias),
                    "packed": lambda m, x: packed_linear.linear(x, packed[m], m.bias)}
            wins = {shape: [] for shape in shapes}
            for tokens in TOKENS:
                xs = {m.in_features: tuning.sample_input(tokens, m.in_features) for m in sample}
                best = {(way, shape): float("inf") for way in ways for shape in shapes}
                for i in range(tuning.REPEATS + 1):  # interleaved passes; the first untimed
                    for way in (list(ways) if i % 2 else list(ways)[::-1]):
                        spent = dict.fromkeys(shapes, 0.0)
                        for m in sample:
                            start = time.perf_counter()
                            ways[way](m, xs[m.in_features])
                            spent[_shape(m)] += time.perf_counter() - start
                        if i:
                            for shape in shapes:
                                best[way, shape] = min(best[way, shape], spent[shape])
                for shape in shapes:
                    times = {way: best[way, shape] for way in ways}
                    wins[shape].append(tuning.pick(times, "plain") == "packed")
        # From the first count past which the copy always wins.
        verdict = {}
        for shape, won in wins.items():
            first = next((i for i in range(len(TOKENS)) if all(won[i:])), None)
            verdict[shape] = NEVER if first is None else TOKENS[first]
        return verdict
    return tuning.tuned("prepack", shapes, measure)


class PackedLinears:
    """See the module docstring. ``model``: the PEFT model; ``state``: its state, whose ``packed``
    keeps the copies; ``check``: the call's source check (derived.py). ``copies``: {layer: (its copy,
    the fewest tokens it runs the copy at)}."""

    KIND = "packed"

    def __init__(self, model, state, mode="auto", check: SourceCheck | None = None):
        self.mode, self.copies = mode, {}
        modules = [m for m in linears(model) if _eligible(m)] if mode is not False else []
        if modules and mode == "auto":
            fewest = thresholds(modules)
            modules = [m for m in modules if fewest[_shape(m)] < NEVER]
        else:
            fewest = {_shape(m): 1 for m in modules}
        kept = state.packed
        kept.keep_only(modules)  # copies of layers no longer in the model (or no longer faster) are dropped
        if not modules:
            return
        new = sum(m.weight.numel() * 4 for m in modules if kept.kept(m, self.KIND) is None)
        room = available_bytes()
        if mode == "auto" and new and room is not None and 2 * new > room:
            logger.info("hf_invisiblelora: linear layers not prepacked (%d MB of copies; %d MB of memory available).",
                        new >> 20, room >> 20)
            state.packed = DerivedCopies()
            return
        check = check or SourceCheck()
        check.prefetch([m.weight for m in modules])
        with torch.no_grad():
            self.copies = {m: (kept.get(m, self.KIND, (m.weight,), lambda m=m: packed_linear.pack(m.weight), check),
                               fewest[_shape(m)]) for m in modules}

    @contextlib.contextmanager
    def installed(self, context):
        """Route the layers to their copies in every one of ``context``'s passes (routing.py; a
        drafter's own layers take their place in its passes); restore on exit."""
        routes = {m: (ALL, self._route(m, packed, fewest, context)) for m, (packed, fewest) in self.copies.items()}
        with context.router.routing(routes):
            yield self

    @staticmethod
    def _route(m, packed, fewest: int, context):
        def route(original, x, *args, **kwargs):
            # Compiled passes trace the layer as it is (Inductor packs weights its own way).
            if not args and not kwargs and x.dtype == torch.float32 and not torch.compiler.is_compiling():
                real = real_tokens(context, x)  # a ragged pass: the real tokens only
                if real is not None:
                    if real.numel() >= fewest:
                        return on_real(x, real, lambda t: packed_linear.linear(t, packed, m.bias))
                elif x.numel() >= fewest * x.shape[-1]:
                    return packed_linear.linear(x, packed, m.bias)
            return original(x, *args, **kwargs)
        return route
