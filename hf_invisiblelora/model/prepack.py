"""The model's float32 linear layers with prepacked weights in our passes (the CPU).

    packed = PackedLinears(peft_model, state, "auto", check)  # once per call: the copies checked or made
    with packed.installed(context): ...                # our passes run them (the pass context, context.py)

Every plain ``nn.Linear`` with a plain float32 weight on the CPU (the base layers under PEFT's
LoRA wrappers, the layers no adapter targets, the output head; not the adapters' own lora_A /
lora_B, which the bank reads from its stacks; quantized layers compute as they are: quantized.py)
can get a copy of its weight packed once for oneDNN or for MKL (kernels/packed_linear.py), kept in
the model state while the weight is unchanged; our passes (prefill, LoRA-on, draft, verify) run it,
anything else (another thread, a user's processor calling the model) gets the layers as they are.
A drafter's low-precision layers take the place of these in its passes.

Whether a copy is faster than PyTorch's own ``F.linear``, and which, depends on the CPU and on the
tokens a pass gives the layer: on an AVX2 EPYC oneDNN's was up to 2x faster at every count; on a
Xeon with AMX oneDNN's was 1.3-1.5x slower at 1-3 tokens and about even from 4, MKL's even at 1-2
and 0.77-0.85x from 4. So ``prepack="auto"`` measures all three on the model's own layers, per
weight shape and token count (``choices``; tuning.py: once per machine, cached), and a layer
keeps the copy of the format that wins at the most counts and runs it at those counts, ``F.linear``
at the others; layers whose copies are never faster get none. A copy costs the weight's size again in
memory: "auto" makes none unless they fit in half the memory available. ``True``: every layer,
every token count, the first format that works (oneDNN's); ``False``: none. The output is the
model's up to float32 rounding (another kernel: another order of summation, as a batch of another
size is for MKL), so greedy tokens can differ from stock's only at near ties of its logits.

A copy is used only while its weight is provably the one it was made from (derived.py: every
route of change is seen).
"""

from __future__ import annotations

import bisect
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
# Tokens per layer at which "auto" times the matmuls; a count between two takes the verdict of the
# one below it, and past the last, the last one's.
TOKENS = (1, 2, 3, 4, 6, 8, 16, 32)
SAMPLE_EVERY = 3  # the layers timed: every third in the model's order


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


def choices(modules) -> dict:
    """{weight shape "out x in": [the copy's format (kernels/packed_linear.py) or None, the counts of
    TOKENS at which the copy is faster than F.linear]}, timed on a sample of the layers in the
    model's order (every layer of SAMPLE_EVERY, so that the weights stream through the caches as in
    a pass; each call timed, summed per shape, the fastest of the repeats; tuning.py: once per
    machine, the reference F.linear). One copy per layer: the format faster at the most counts (a
    tie: the one faster over them)."""
    shapes = sorted({_shape(m) for m in modules})
    sample = modules[::SAMPLE_EVERY] + [m for m in modules[-1:] if m not in modules[::SAMPLE_EVERY]]
    sample += [next(m for m in modules if _shape(m) == shape) for shape in shapes
               if all(_shape(m) != shape for m in sample)]  # every shape at least once
    formats = packed_linear.formats(torch.float32, torch.device("cpu"))

    def measure():
        with torch.no_grad():
            packed = {(fmt, m): packed_linear.pack(m.weight, fmt) for fmt in formats for m in sample}
            ways = {"plain": lambda m, x: nn.functional.linear(x, m.weight, m.bias)}
            ways.update({fmt: lambda m, x, fmt=fmt: packed_linear.linear(x, packed[fmt, m], m.bias) for fmt in formats})
            wins = {(fmt, shape): {} for fmt in formats for shape in shapes}  # {tokens: the copy's time} where it won
            for tokens in TOKENS:
                xs = {m.in_features: tuning.sample_input(tokens, m.in_features) for m in sample}
                best = {(way, shape): float("inf") for way in ways for shape in shapes}
                for i in range(tuning.REPEATS + 1):  # interleaved passes; the first untimed
                    order = list(ways)
                    for way in order[i % len(order):] + order[: i % len(order)]:  # rotated: none always first
                        took = dict.fromkeys(shapes, 0.0)
                        for m in sample:
                            start = time.perf_counter()
                            ways[way](m, xs[m.in_features])
                            took[_shape(m)] += time.perf_counter() - start
                        if i:
                            for shape in shapes:
                                best[way, shape] = min(best[way, shape], took[shape])
                for fmt in formats:
                    for shape in shapes:
                        if tuning.pick({"plain": best["plain", shape], fmt: best[fmt, shape]}, "plain") == fmt:
                            wins[fmt, shape][tokens] = best[fmt, shape]
        verdict = {}
        for shape in shapes:
            won = {fmt: wins[fmt, shape] for fmt in formats if wins[fmt, shape]}
            fmt = min(won, key=lambda f: (-len(won[f]), sum(won[f].values())), default=None)
            verdict[shape] = [fmt, sorted(won.get(fmt, ()))]
        return verdict
    return tuning.tuned("prepack_format", shapes, measure)


class PackedLinears:
    """See the module docstring. ``model``: the PEFT model; ``state``: its state, whose ``packed``
    keeps the copies (of kind "packed:<format>"); ``check``: the call's source check (derived.py).
    ``copies``: {layer: (its copy, the counts of TOKENS it runs the copy at)}."""

    def __init__(self, model, state, mode="auto", check: SourceCheck | None = None):
        self.mode, self.copies = mode, {}
        modules = [m for m in linears(model) if _eligible(m)] if mode is not False else []
        if modules and mode == "auto":
            chosen = choices(modules)
            plan = {m: chosen[_shape(m)] for m in modules if chosen[_shape(m)][1]}  # {layer: [format, counts]}
        else:  # True: every layer at every count, in the first format that works here
            plan = {m: [packed_linear.formats(torch.float32, torch.device("cpu"))[0], TOKENS] for m in modules}
        kinds = {m: f"packed:{fmt}" for m, (fmt, _) in plan.items()}
        kept = state.packed
        kept.keep_only(kinds)  # copies of layers no longer in the model (or no longer faster, or another format) are dropped
        if not plan:
            return
        new = sum(m.weight.numel() * 4 for m in plan if kept.kept(m, kinds[m]) is None)
        room = available_bytes()
        if mode == "auto" and new and room is not None and 2 * new > room:
            logger.info("hf_invisiblelora: linear layers not prepacked (%d MB of copies; %d MB of memory available).",
                        new >> 20, room >> 20)
            state.packed = DerivedCopies()
            return
        check = check or SourceCheck()
        check.prefetch([m.weight for m in plan])
        with torch.no_grad():
            self.copies = {m: (kept.get(m, kinds[m], (m.weight,), lambda m=m, fmt=fmt: packed_linear.pack(m.weight, fmt),
                                        check), frozenset(counts)) for m, (fmt, counts) in plan.items()}

    @contextlib.contextmanager
    def installed(self, context):
        """Route the layers to their copies in every one of ``context``'s passes (routing.py; a
        drafter's own layers take their place in its passes); restore on exit."""
        routes = {m: (ALL, self._route(m, packed, counts, context)) for m, (packed, counts) in self.copies.items()}
        with context.router.routing(routes):
            yield self

    @staticmethod
    def _route(m, packed, counts: frozenset, context):
        # Whether n tokens run the copy: the verdict of the nearest count of TOKENS at or below n.
        top = TOKENS[-1]
        verdicts = tuple(n > 0 and TOKENS[bisect.bisect_right(TOKENS, n) - 1] in counts for n in range(top + 1))

        def runs(tokens: int) -> bool:
            return verdicts[min(tokens, top)]

        def linear(x, plain, bias):
            # Compiled passes trace the layer as it is (Inductor packs weights its own way).
            if x.dtype == torch.float32 and not torch.compiler.is_compiling():
                real = real_tokens(context, x)  # a ragged pass: the real tokens only
                if real is not None:
                    if runs(context.real_count):
                        return on_real(x, real, lambda t: packed_linear.linear(t, packed, bias))
                elif runs(x.numel() // x.shape[-1]):
                    return packed_linear.linear(x, packed, bias)
            return plain(x)

        def route(original, x, *args, **kwargs):
            if args or kwargs:
                return original(x, *args, **kwargs)
            return linear(x, original, m.bias)

        def direct(original, router, drafter):
            # For the passes run as plain functions (router.direct): the layer is a plain Linear
            # (_eligible), its weight and bias read once per call (a call's weights are fixed).
            weight, bias = m.weight, m.bias
            return lambda x: linear(x, lambda x: nn.functional.linear(x, weight, bias), bias)
        route.direct = direct
        return route
