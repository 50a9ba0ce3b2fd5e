"""The model's float32 linear layers with prepacked weights in our passes (the CPU).

    packed = PackedLinears(peft_model, state, "auto", check)  # once per call: the copies checked or made
    with packed.installed(context): ...                # our passes run them (the pass context, context.py)

Every plain ``nn.Linear`` with a plain float32 weight on the CPU (the base layers under PEFT's
LoRA wrappers, the layers no adapter targets, the output head; not the adapters' own lora_A /
lora_B, which the bank reads from its stacks; quantized layers compute as they are: quantized.py) gets a copy of its weight in oneDNN's layout (kernels/packed_linear.py: a
decode step's matmuls up to 2x faster), kept in the model state while the weight is unchanged;
every pass of ours (prefill, LoRA-on, draft, verify) runs them, anything else (another thread, a
user's processor calling the model) gets the layers as they are. A drafter's low-precision layers
take the place of these in its passes.

The copies cost the weights' size again in memory: ``prepack="auto"`` makes them when they fit in
half the memory available, ``True`` always, ``False`` never. The output is the model's up to
float32 rounding (another kernel: another order of summation, as a batch of another size is for
MKL), so greedy tokens can differ from stock's only at near ties of its logits.

A copy is used only while its weight is provably the one it was made from (derived.py: every
route of change is seen).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import nn

from ..kernels import packed_linear
from .context import on_real, real_tokens
from .derived import DerivedCopies, SourceCheck
from .quantized import plain
from .routing import ALL
from .walk import linears

logger = logging.getLogger("hf_invisiblelora")

def check_mode(mode) -> None:
    if not (mode is True or mode is False or isinstance(mode, str) and mode == "auto"):
        raise ValueError(f"prepack must be 'auto', True or False, got {mode!r}.")


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


class PackedLinears:
    """See the module docstring. ``model``: the PEFT model; ``state``: its state, whose ``packed``
    keeps the copies; ``check``: the call's source check (derived.py)."""

    KIND = "packed"

    def __init__(self, model, state, mode="auto", check: SourceCheck | None = None):
        check_mode(mode)
        self.mode, self.copies = mode, {}
        modules = [m for m in linears(model) if _eligible(m)] if mode is not False else []
        kept = state.packed
        kept.keep_only(modules)  # copies of layers no longer in the model are dropped
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
        with torch.no_grad():
            self.copies = {m: kept.get(m, self.KIND, (m.weight,), lambda m=m: packed_linear.pack(m.weight), check)
                           for m in modules}

    @contextlib.contextmanager
    def installed(self, context):
        """Route the layers to their copies in every one of ``context``'s passes (routing.py; a
        drafter's own layers take their place in its passes); restore on exit."""
        with context.router.routing({m: (ALL, self._route(m, packed, context)) for m, packed in self.copies.items()}):
            yield self

    @staticmethod
    def _route(m, packed, context):
        def route(original, x, *args, **kwargs):
            # Compiled passes trace the layer as it is (Inductor packs weights its own way).
            if not args and not kwargs and x.dtype == torch.float32 and not torch.compiler.is_compiling():
                real = real_tokens(context, x)  # a ragged pass: the real tokens only
                if real is not None:
                    return on_real(x, real, lambda t: packed_linear.linear(t, packed, m.bias))
                return packed_linear.linear(x, packed, m.bias)
            return original(x, *args, **kwargs)
        return route
