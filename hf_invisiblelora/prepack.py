"""The model's float32 linear layers with prepacked weights in our passes (the CPU).

    packed = PackedLinears(inner, state, "auto")      # once per session: the copies checked or made
    with packed.installed(context): ...                # our passes run them (the pass context, context.py)

Every plain ``nn.Linear`` with a plain float32 weight on the CPU (the base layers under PEFT's
LoRA wrappers, the layers no adapter targets, the output head; quantized layers compute as they
are: quantized.py) gets a copy of its weight in oneDNN's layout (kernels/packed_linear.py: a
decode step's matmuls up to 2x faster), kept in the model state while the weight is unchanged;
every pass of ours (prefill, LoRA-on, draft, verify) runs them, anything else (another thread, a
user's processor calling the model) gets the layers as they are. A drafter's low-precision layers
take the place of these in its passes.

The copies cost the weights' size again in memory: ``prepack="auto"`` makes them when they fit in
half the memory available, ``True`` always, ``False`` never. The output is the model's up to
float32 rounding (another kernel: another order of summation, as a batch of another size is for
MKL), so greedy tokens can differ from stock's only at near ties of its logits.

A copy must not outlive a change of its weight. Each session compares every layer's weight with
what its copy was made from: the same tensor, storage and version counter (in-place ops,
``load_state_dict``, optimizer steps) and the same row sums of its bits (edits through ``.data``,
which bump no version counter; PEFT merging adapters, which edits that way, is refused before).
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from typing import NamedTuple

import torch
from torch import nn

from .kernels import packed_linear
from .quantized import plain
from .state import forwards

logger = logging.getLogger("hf_invisiblelora")

def check_mode(mode) -> None:
    if not (mode is True or mode is False or isinstance(mode, str) and mode == "auto"):
        raise ValueError(f"prepack must be 'auto', True or False, got {mode!r}.")


class _Copy(NamedTuple):
    module: weakref.ref
    tag: tuple  # the weight tensor, its storage and version counter when packed
    sums: torch.Tensor  # [out] int32: each row's bits summed (wrapping): sees edits no version counter records
    packed: torch.Tensor


def _tag(w: torch.Tensor) -> tuple:
    return id(w), w.data_ptr(), w._version, tuple(w.shape), w.stride()


def _row_sums(w: torch.Tensor) -> torch.Tensor:
    # One read of the weight (a plain sum's cost). Any edit of one element changes its row's sum.
    return w.detach().view(torch.int32).sum(1, dtype=torch.int32)


def _eligible(m) -> bool:
    """A plain Linear whose forward is only F.linear of its weight: not routed by anyone else (an
    accelerate hook sets ``forward``), no pre-hook that recomputes its weight (pruning), a plain
    float weight (a quantized one, a torchao tensor subclass, computes its own linear)."""
    w = getattr(m, "weight", None)
    return type(m) is nn.Linear and plain(w) and w.dim() == 2 \
        and packed_linear.available(w.dtype, w.device) and "forward" not in m.__dict__ and not m._forward_pre_hooks


def _available_bytes() -> int | None:
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
    """See the module docstring. ``state``: the model state whose ``packed`` keeps the copies."""

    def __init__(self, model, state, mode="auto"):
        check_mode(mode)
        self.mode, self.copies = mode, []
        modules = [m for m in model.modules() if _eligible(m)] if mode is not False else []
        if not modules:
            state.packed = {}
            return
        kept = state.packed
        new = sum(m.weight.numel() * 4 for m in modules if id(m) not in kept)
        room = _available_bytes()
        if mode == "auto" and new and room is not None and 2 * new > room:
            logger.info("hf_invisiblelora: linear layers not prepacked (%d MB of copies; %d MB of memory available).",
                        new >> 20, room >> 20)
            state.packed = {}
            return
        fresh = {}
        with torch.no_grad():
            for m in modules:
                w, copy = m.weight, kept.get(id(m))
                sums = _row_sums(w)
                if copy is None or copy.module() is not m or copy.tag != _tag(w) or not torch.equal(copy.sums, sums):
                    copy = _Copy(weakref.ref(m), _tag(w), sums, packed_linear.pack(w))
                fresh[id(m)] = copy
        state.packed = fresh  # copies of layers no longer in the model are dropped
        self.copies = list(fresh.values())

    @contextlib.contextmanager
    def installed(self, context):
        """Route the layers' forwards to their copies in ``context``'s passes; restore on exit."""
        routed = {}
        for copy in self.copies:
            m = copy.module()
            if m is not None:  # a layer the model dropped since (a serving engine's adapter changes)
                routed[m] = self._routed(m, m.forward, copy.packed, context)
        with forwards(routed):
            yield self

    @staticmethod
    def _routed(m, original, packed, context):
        def forward(x, *args, **kwargs):
            # Compiled passes trace the layer as it is (Inductor packs weights its own way).
            if not args and not kwargs and x.dtype == torch.float32 and not torch.compiler.is_compiling() \
                    and context.mine():
                return packed_linear.linear(x, packed, m.bias)
            return original(x, *args, **kwargs)
        return forward
