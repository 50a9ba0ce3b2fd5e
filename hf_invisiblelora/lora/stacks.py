"""One LoRA layer's adapters stacked in the bank's fixed slots (``Stacks``), sibling layers that share
an input and so one shrink (``Group``), and the active slots' weights packed side by side at their own
ranks (``Packed``, kept per active set: ``Packs``). The bank (bank.py) holds one Stacks per LoRA layer;
what a layer computes from them is layer.py's. DoRA's column scales and the finite check are here
because a slot is written here: by PEFT's own methods, from the adapter's current weights.
"""

import itertools
import weakref
from typing import NamedTuple

import torch
from peft.utils.integrations import dequantize_module_weight

from ..model.derived import SourceCheck
from ..model.quantized import rounds_delta
from ..model.walk import named_lora_layers


def laid_out(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``t`` [S, M, N] with the same values, stored as [S, N, M] if ``transposed`` (a view of it)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if transposed else t.contiguous()


class Packed(NamedTuple):
    """Active slots' weights side by side at their own ranks (the stacks pad every slot to the
    largest rank of the bank): A [in, n] (None for a layer in a group), B [n, out] (None for a
    group), the slot of each of the n columns, and a key for what the columns are (the slots'
    ranks; masks are cached by it). A group's: its layers' A side by side, and each layer's
    columns {id(layer): slice}. A fixed pack (``AdapterBank.fix``) has its own width and a layer
    in a group has its columns in the group's fixed pack as ``columns``."""

    A: torch.Tensor | None
    B: torch.Tensor | None
    col_slot: torch.Tensor
    key: tuple
    columns: dict | slice | None = None


def fixed_into(buffer, value):
    """``value`` in ``buffer`` if it has its shape (compiled passes keep reading the same tensor),
    else ``value`` as the new buffer."""
    if buffer is not None and buffer.shape == value.shape:
        return buffer.copy_(value)
    return value


def padded(A, B, col_slot, width: int, buffers):
    """A [in, n], B [n, out], col_slot [n] padded to ``width`` columns (zero weights; slot -2, which
    no token has), in ``buffers`` (a previous fixed pack) where shapes allow."""
    pad = width - col_slot.shape[0]
    A = None if A is None else fixed_into(buffers and buffers.A, torch.nn.functional.pad(A, (0, pad)))
    B = None if B is None else fixed_into(buffers and buffers.B, torch.nn.functional.pad(B, (0, 0, 0, pad)))
    col_slot = fixed_into(buffers and buffers.col_slot, torch.nn.functional.pad(col_slot, (0, pad), value=-2))
    return A, B, col_slot


class Packs:
    """Packed weights per set of active slots, the last few kept: a decode loop keeps its set for
    many steps; a serving engine changes it as requests come and go. ``make(slots)`` packs a set; it
    is passed in rather than kept, so a layer and its packs hold no reference cycle (see AdapterBank)."""

    KEEP = 4

    def __init__(self):
        self.cache = {}

    def get(self, slots, make) -> Packed:
        hit = self.cache.get(slots)
        if hit is None:
            with torch.no_grad():
                hit = make(slots)
            if len(self.cache) >= self.KEEP:
                self.cache.pop(next(iter(self.cache)))  # the oldest
            self.cache[slots] = hit
        return hit

    def clear(self) -> None:
        self.cache = {}


def stacked_values(m, a: str, dtype) -> tuple:
    """Adapter ``a``'s stacked values in LoRA layer ``m``: A, and B * scaling (scaled in the adapter's
    own dtype before any cast, as PEFT does), in ``dtype``."""
    return m.lora_A[a].weight.to(dtype), (m.lora_B[a].weight * m.scaling[a]).to(dtype)


def _finite(*tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def nonfinite(model, adapter: str) -> str | None:
    """The first LoRA layer of ``model`` where ``adapter``'s values as the bank stacks them (A, B *
    scaling, a DoRA scale; an embedding's A and B * scaling) are not all finite, or None."""
    with torch.no_grad():
        for name, m in named_lora_layers(model):
            if adapter in m.lora_A:
                A, B = stacked_values(m, adapter, torch.promote_types(m.lora_A[adapter].weight.dtype,
                                                               m.lora_B[adapter].weight.dtype))
                values = (A, B, dora_scale(m, adapter)) if adapter in m.lora_magnitude_vector else (A, B)
            elif adapter in m.lora_embedding_A:
                values = (m.lora_embedding_A[adapter], m.lora_embedding_B[adapter] * m.scaling[adapter])
            else:
                continue
            if not _finite(*values):
                return name
    return None


def dora_scale(m, a: str) -> torch.Tensor:
    """DoRA's column scale of adapter ``a`` in layer ``m``, magnitude / ||W + scaling * B @ A||, by
    PEFT's own DoraLinearLayer methods as its forward calls them (in the adapter's dtype: the input's,
    cast to it)."""
    dora, lora_A = m.lora_magnitude_vector[a], m.lora_A[a]
    dtype = lora_A.weight.dtype
    lora_weight = dora.get_lora_weight(lora_A=lora_A, lora_B=m.lora_B[a], adapter_name=a).to(dtype)
    weight = dequantize_module_weight(m.get_base_layer()).to(dtype)
    return dora.weight / dora.get_weight_norm(weight=weight, lora_weight=lora_weight, scaling=m.scaling[a],
                                              adapter_name=a)


class Stacks:
    """One LoRA layer's stacked weights: A [S, R, in], B*scaling [S, out, R] (zeros where absent).
    R is the largest rank rounded up to a multiple of 4 (aligned slices for grouped matmuls).
    ``transposed``: store them as [S, in, R] and [S, R, out], the layout the torch path's matmuls
    read fastest (x @ A[s].T); the Triton kernels take either through strides.
    DoRA slots (``dora``): ``scale`` [S + 1, out] their column scales (ones elsewhere; the last row
    for slot -1, no LoRA), ``is_dora`` [S + 1] which slots they are. ``sources``: per slot, the
    digests of what it was written from (derived.py)."""

    def __init__(self, m, names, dtype, transposed: bool, check: SourceCheck):
        self.module, self.names = m, names
        ranks = {a: m.lora_A[a].weight.shape[0] for a in m.lora_A}
        r_max = -(-max(ranks.values()) // 4) * 4
        like = dict(dtype=dtype, device=m.get_base_layer().weight.device)
        self.A = laid_out(torch.zeros(len(names), r_max, m.in_features, **like), transposed)
        self.B = laid_out(torch.zeros(len(names), m.out_features, r_max, **like), transposed)
        self.ranks = [ranks.get(a, 0) for a in names]  # per slot, 0 where absent
        self.live = frozenset(s for s, r in enumerate(self.ranks) if r)  # the slots with weights here
        self.packs = Packs()
        self.group, self.cols = None, (0, r_max)
        self.rounds = rounds_delta(m)  # the layer rounds its LoRA terms also for one adapter (quantized.py)
        self.fixed = None  # this layer's fixed pack (AdapterBank.fix)
        self.dora = {slot for slot, a in enumerate(names) if a in m.lora_magnitude_vector}
        if self.dora:
            self.scale = torch.ones(len(names) + 1, m.out_features, **like)
            self.is_dora = torch.tensor([s in self.dora for s in range(len(names) + 1)], device=like["device"])
        self.sources, self.nonfinite = {}, set()  # nonfinite: slots with a value that is not finite
        for slot, a in enumerate(names):
            if a in ranks:
                self.write(slot, a, check)

    def pack(self, slots) -> "Packed":
        # One copy each, straight into the layout the matmuls read (a serving engine repacks whenever
        # its set of adapters changes). A grouped layer's A is packed by its group.
        ranks = [self.ranks[s] for s in slots]
        A = None if self.group is not None else torch.cat([self.A[s, :r].T for s, r in zip(slots, ranks)], dim=1)
        B = torch.cat([self.B[s, :, :r].T for s, r in zip(slots, ranks)])
        col_slot = torch.tensor([s for s, r in zip(slots, ranks) for _ in range(r)], dtype=torch.long, device=B.device)
        return Packed(A, B, col_slot, tuple(ranks))

    def _sources(self, slot: int, a: str) -> tuple:
        """What slot ``slot`` (adapter ``a``) is computed from: its weights and scaling; a DoRA slot's
        scale also from its magnitude and the base weight."""
        m = self.module
        sources = (m.lora_A[a].weight, m.lora_B[a].weight, m.scaling[a])
        if slot in self.dora:
            sources += (m.lora_magnitude_vector[a].weight, m.get_base_layer().weight)
        return sources

    @torch.no_grad()
    def write(self, slot: int, a: str, check: SourceCheck) -> None:
        A, B = stacked_values(self.module, a, self.A.dtype)
        r = A.shape[0]
        self.A[slot, :r], self.B[slot, :, :r] = A, B
        finite = _finite(A, B)
        if slot in self.dora:  # in place: compiled passes keep reading the same tensor
            self.scale[slot] = dora_scale(self.module, a)
            finite = finite and _finite(self.scale[slot])
        (self.nonfinite.discard if finite else self.nonfinite.add)(slot)
        self.sources[slot] = check(self._sources(slot, a))
        self.packs.clear()
        if self.group is not None:
            self.group.packs.clear()

    def changed(self, check: SourceCheck, adapters=None) -> list:
        """(slot, adapter) whose sources changed since the slot was written, by any route (derived.py);
        only ``adapters`` if given."""
        return [(slot, a) for slot, a in enumerate(self.names)
                if a in self.module.lora_A and (adapters is None or a in adapters)
                and check(self._sources(slot, a)) != self.sources[slot]]


class Group:
    """LoRA layers fed the same input: their A stacked along the rank axis for one shared shrink.
    The last shrink's result is kept for the siblings, keyed by the input tensor and metadata."""

    def __init__(self, layers, transposed: bool):
        self.A = laid_out(torch.cat([layer.A for layer in layers], dim=1), transposed)
        start = 0
        for layer in layers:
            r = layer.A.shape[1]
            # A persistent view: the torch path caches prepared weights by tensor identity, and
            # writes to a layer's slot land in the group's stack.
            layer.A, layer.cols, layer.group = self.A[:, start : start + r], (start, start + r), self
            start += r
        # Per slot, the columns a shrink of the slot needs: up to its last layer's rank (lora/layer.py's runs).
        self.ends = [max((layer.cols[0] + r for layer in layers for r in [layer.ranks[s]] if r), default=0)
                     for s in range(self.A.shape[0])]
        self._layers = [weakref.ref(layer) for layer in layers]  # weak: each layer holds its group
        self.packs = Packs()
        self.fixed = None
        self.clear()

    @property
    def layers(self) -> list:
        return [ref() for ref in self._layers]

    def pack(self, slots) -> "Packed":
        layers = self.layers
        parts = [layer.packs.get(slots, layer.pack) for layer in layers]
        A = torch.cat([layer.A[s, :r].T for layer, p in zip(layers, parts) for s, r in zip(slots, p.key)], dim=1)
        widths = [len(p.col_slot) for p in parts]
        columns = {id(layer): slice(end - w, end) for layer, w, end in zip(layers, widths, itertools.accumulate(widths))}
        return Packed(A, None, torch.cat([p.col_slot for p in parts]),
                       tuple(p.key for p in parts), columns)

    def clear(self):
        self.x = self.version = self.meta = self.y = None
