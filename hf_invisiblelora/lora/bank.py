"""The adapter bank: every adapter's LoRA weights stacked per layer in fixed slots, and the
per-forward metadata that lets one batched op per layer replace PEFT's loop over adapters (what a
layer computes from them is layer.py).

    bank = get_bank(peft_model)                      # built once, re-synced per call
    with bank.installed(context):                    # the decoder's pass context (context.py)
        with context.running(..., adapters=bank.slots(["math", "__base__", "code"])):
            logits = peft_model(input_ids).logits     # every LoRA layer reads the rows' slots there

Numerics follow PEFT: the stacks keep the adapters' own dtype (PEFT keeps float32 adapters on a
bfloat16 model), the input is cast to it, and the delta is added as PEFT adds it: rounded to the
output's dtype first for a mixed batch (``adapter_names=``), in the adapters' dtype otherwise
(PEFT's bitsandbytes layers round it always). A quantized base layer computes its own output.

DoRA adapters (PEFT's DoraLinearLayer, eval mode) scale each output column by magnitude /
||W + scaling * B @ A||, fixed while the weights are: each layer with DoRA slots keeps that scale per
slot (ones for plain LoRA and for no LoRA), computed by PEFT's own methods when a slot is written
(again when the adapter's weights, scaling or magnitude or the base weight W change), and turns a
token's base output and delta into
out + (scale - 1) * (out - bias) + scale * delta by the token's slot, rounded once as PEFT's DoRA
forward rounds it. Embedding LoRA (PEFT's Embedding) is not stacked: its one layer per model adds
PEFT's own term per adapter to the adapter's tokens, from PEFT's weights at each pass.
"""

import contextlib
import itertools
import weakref
from typing import NamedTuple

import torch
from peft.utils.integrations import dequantize_module_weight

from ..kernels import torch_lora
from ..kernels.meta import get_backend, make_meta
from ..model.derived import SourceCheck
from ..model.quantized import rounds_delta
from ..model.routing import ALL
from ..model.state import state_of
from ..model.walk import layer_adapters, named_lora_layers
from . import layer as lora_layer

# Sibling LoRA layers that read the same input tensor in the architectures we know. Their shrinks
# become one matmul over the concatenated A (measured on the CPU: one shrink for q/k/v costs
# 40-45% of three separate ones). Only used when the siblings really get the same tensor.
SHARED_INPUT = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})


def _laid_out(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``t`` [S, M, N] with the same values, stored as [S, N, M] if ``transposed`` (a view of it)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if transposed else t.contiguous()


class _Packed(NamedTuple):
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


def _fixed(buffer, value):
    """``value`` in ``buffer`` if it has its shape (compiled passes keep reading the same tensor),
    else ``value`` as the new buffer."""
    if buffer is not None and buffer.shape == value.shape:
        return buffer.copy_(value)
    return value


def _padded(A, B, col_slot, width: int, buffers):
    """A [in, n], B [n, out], col_slot [n] padded to ``width`` columns (zero weights; slot -2, which
    no token has), in ``buffers`` (a previous fixed pack) where shapes allow."""
    pad = width - col_slot.shape[0]
    A = None if A is None else _fixed(buffers and buffers.A, torch.nn.functional.pad(A, (0, pad)))
    B = None if B is None else _fixed(buffers and buffers.B, torch.nn.functional.pad(B, (0, 0, 0, pad)))
    col_slot = _fixed(buffers and buffers.col_slot, torch.nn.functional.pad(col_slot, (0, pad), value=-2))
    return A, B, col_slot


class _Packs:
    """Packed weights per set of active slots, the last few kept: a decode loop keeps its set for
    many steps; a serving engine changes it as requests come and go. ``make(slots)`` packs a set; it
    is passed in rather than kept, so a layer and its packs hold no reference cycle (see AdapterBank)."""

    KEEP = 4

    def __init__(self):
        self.cache = {}

    def get(self, slots, make) -> _Packed:
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


def _values(m, a: str, dtype) -> tuple:
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
                A, B = _values(m, adapter, torch.promote_types(m.lora_A[adapter].weight.dtype,
                                                               m.lora_B[adapter].weight.dtype))
                values = (A, B, _dora_scale(m, adapter)) if adapter in m.lora_magnitude_vector else (A, B)
            elif adapter in m.lora_embedding_A:
                values = (m.lora_embedding_A[adapter], m.lora_embedding_B[adapter] * m.scaling[adapter])
            else:
                continue
            if not _finite(*values):
                return name
    return None


def _dora_scale(m, a: str) -> torch.Tensor:
    """DoRA's column scale of adapter ``a`` in layer ``m``, magnitude / ||W + scaling * B @ A||, by
    PEFT's own DoraLinearLayer methods as its forward calls them (in the adapter's dtype: the input's,
    cast to it)."""
    dora, lora_A = m.lora_magnitude_vector[a], m.lora_A[a]
    dtype = lora_A.weight.dtype
    lora_weight = dora.get_lora_weight(lora_A=lora_A, lora_B=m.lora_B[a], adapter_name=a).to(dtype)
    weight = dequantize_module_weight(m.get_base_layer()).to(dtype)
    return dora.weight / dora.get_weight_norm(weight=weight, lora_weight=lora_weight, scaling=m.scaling[a],
                                              adapter_name=a)


class _Stacks:
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
        self.A = _laid_out(torch.zeros(len(names), r_max, m.in_features, **like), transposed)
        self.B = _laid_out(torch.zeros(len(names), m.out_features, r_max, **like), transposed)
        self.ranks = [ranks.get(a, 0) for a in names]  # per slot, 0 where absent
        self.packs = _Packs()
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

    def pack(self, slots) -> "_Packed":
        # One copy each, straight into the layout the matmuls read (a serving engine repacks whenever
        # its set of adapters changes). A grouped layer's A is packed by its group.
        ranks = [self.ranks[s] for s in slots]
        A = None if self.group is not None else torch.cat([self.A[s, :r].T for s, r in zip(slots, ranks)], dim=1)
        B = torch.cat([self.B[s, :, :r].T for s, r in zip(slots, ranks)])
        col_slot = torch.tensor([s for s, r in zip(slots, ranks) for _ in range(r)], dtype=torch.long, device=B.device)
        return _Packed(A, B, col_slot, tuple(ranks))

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
        A, B = _values(self.module, a, self.A.dtype)
        r = A.shape[0]
        self.A[slot, :r], self.B[slot, :, :r] = A, B
        finite = _finite(A, B)
        if slot in self.dora:  # in place: compiled passes keep reading the same tensor
            self.scale[slot] = _dora_scale(self.module, a)
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


class _Group:
    """LoRA layers fed the same input: their A stacked along the rank axis for one shared shrink.
    The last shrink's result is kept for the siblings, keyed by the input tensor and metadata."""

    def __init__(self, layers, transposed: bool):
        self.A = _laid_out(torch.cat([layer.A for layer in layers], dim=1), transposed)
        start = 0
        for layer in layers:
            r = layer.A.shape[1]
            # A persistent view: the torch path caches prepared weights by tensor identity, and
            # writes to a layer's slot land in the group's stack.
            layer.A, layer.cols, layer.group = self.A[:, start : start + r], (start, start + r), self
            start += r
        self._layers = [weakref.ref(layer) for layer in layers]  # weak: each layer holds its group
        self.packs = _Packs()
        self.fixed = None
        self.clear()

    @property
    def layers(self) -> list:
        return [ref() for ref in self._layers]

    def pack(self, slots) -> "_Packed":
        layers = self.layers
        parts = [layer.packs.get(slots, layer.pack) for layer in layers]
        A = torch.cat([layer.A[s, :r].T for layer, p in zip(layers, parts) for s, r in zip(slots, p.key)], dim=1)
        widths = [len(p.col_slot) for p in parts]
        columns = {id(layer): slice(end - w, end) for layer, w, end in zip(layers, widths, itertools.accumulate(widths))}
        return _Packed(A, None, torch.cat([p.col_slot for p in parts]),
                       tuple(p.key for p in parts), columns)

    def clear(self):
        self.x = self.version = self.meta = self.y = None


class AdapterBank:
    """Every adapter's LoRA weights of a PEFT model, stacked per LoRA layer in fixed slots.

    Installed for one call with the call's pass context (context.py): each LoRA layer reads the
    rows' adapters from it; other threads calling the model meanwhile get PEFT's own forward.

    Its layers, groups and packs hold no reference cycles, so the stacks an adapter change replaces
    are freed at once. (A layer and its packs, and a layer and its group, were cycles: every
    rebuilt bank stayed alive until the garbage collector's next full pass, and a server on SmolLM2
    grew by 100-300 MB per adapter load or unload.)
    """

    def __init__(self, model, check: SourceCheck | None = None):
        self.model = model
        self._signature = None
        self.version = 0  # bumped when the stacks are reallocated (a graph holding them must be redone)
        self.context = None  # the pass context of the call it is installed for
        self.round_delta = True  # PEFT's mixed-batch numerics (see the module docstring)
        self._last_meta = None  # last LoRA metadata: its weight cache outlives draft passes
        self._memo_rows, self._memo = None, {}  # metadata per tokens_per_row for the current row_slots
        self._ragged = (None, None, {})  # the last ragged pass's lens, row slots and metadata per tokens
        self.sync(check=check)

    def _structure(self):
        # What the stacks' shapes, dtypes and devices depend on.
        sig = []
        for _, m in named_lora_layers(self.model):
            sig.append(id(m))
            for a, lin in m.lora_A.items():
                wa, wb = lin._parameters["weight"], m.lora_B[a]._parameters["weight"]
                sig.append((a, wa.shape, wb.shape, wa.dtype, wb.dtype, wa.device, wb.device))
            # Embedding adapters take slots (their weights are read at each pass); DoRA's scales are stacked.
            sig.append((tuple(m.lora_embedding_A), tuple((a, d.weight.dtype, d.weight.device)
                                                          for a, d in m.lora_magnitude_vector.items())))
        return tuple(sig)

    def sync(self, adapters=None, check: SourceCheck | None = None) -> None:
        """Follow the model's adapters: rebuild the stacks if adapters were added, deleted or moved
        (device, dtype); rewrite the slots whose sources changed (weights, scaling, a DoRA slot's
        magnitude and base weight; by any route: derived.py). ``adapters``: compare only these
        adapters' slots (those a call uses; the others are compared when a call uses them);
        ``check``: the call's source check."""
        check = check or SourceCheck()
        signature = self._structure()
        if signature != self._signature:
            self._build(check)
            self._signature = signature
            return
        changed = [(layer, slot, a) for layer in self.layers.values() for slot, a in layer.changed(check, adapters)]
        for layer, slot, a in changed:
            layer.write(slot, a, check)
        if changed:
            self._drop_prepared()

    def _build(self, check: SourceCheck) -> None:
        modules = named_lora_layers(self.model)
        if not modules:
            raise ValueError("no PEFT LoRA layers found in the model")
        if self.context is not None and [m for _, m in modules] != [m for _, m in self.modules]:
            # installed() routed the layers there were: new ones would run PEFT's forward in our passes
            raise RuntimeError("The model's LoRA layers changed during a call (an adapter added to or deleted from "
                               "other layers meanwhile); change adapters between calls.")
        self.modules = modules
        names = list(dict.fromkeys(a for _, m in self.modules for a in layer_adapters(m)))
        self.adapter_names = names
        weight = self.modules[0][1].get_base_layer().weight
        self.device = weight.device
        adapters = [w for _, m in self.modules for a in m.lora_A for w in (m.lora_A[a].weight, m.lora_B[a].weight)]
        dtype = adapters[0].dtype if adapters else weight.dtype  # embedding LoRA alone: no stacks
        for w in adapters:
            dtype = torch.promote_types(dtype, w.dtype)
        self.dtype = dtype
        self.ops = get_backend(self.device, dtype)
        transposed = self.ops is torch_lora
        self.layers = {m: _Stacks(m, names, dtype, transposed, check) for _, m in self.modules if len(m.lora_A)}
        self.groups = self._make_groups(transposed)
        # One route per layer for the bank's lifetime (routing.py). It reads the layer's stacks when it
        # runs: a rebuild while installed (a call's sync) moves slots and stacks together.
        self._routes = {
            m: (lambda original, x, *args, _m=m, **kwargs:
                lora_layer.forward(self, _m, self.layers.get(_m), x, *args, **kwargs))
            for _, m in self.modules
        }
        self.version += 1
        self._drop_prepared()

    def _drop_prepared(self) -> None:
        # Metadata carries prepared copies of the stacks (torch path): they are stale now.
        self._last_meta = None
        self._memo_rows, self._memo = None, {}
        self._ragged = (None, None, {})
        for packs in [layer.packs for layer in self.layers.values()] + [group.packs for group in self.groups]:
            packs.clear()

    def _make_groups(self, transposed: bool):
        siblings = {}
        for name, m in self.modules:
            parent, _, leaf = name.rpartition(".")
            kind = next((i for i, leaves in enumerate(SHARED_INPUT) if leaf in leaves), None)
            if m in self.layers and kind is not None:
                siblings.setdefault((parent, kind, m.in_features), []).append(self.layers[m])
        return [_Group(layers, transposed) for layers in siblings.values() if len(layers) > 1]

    @torch.no_grad()
    def fix(self, slots: tuple, adapters: int, rank: int) -> None:
        """Packs of the active ``slots`` for passes with static metadata (compiled passes): each
        layer's packed weights padded to the width that any ``adapters`` adapters of rank <= ``rank``
        fit in (at most the sum of the layer's largest ``adapters`` ranks), so a compiled pass keeps
        its shapes for any such set; written into the last call's tensors where the widths agree."""
        def width(layer):
            most = min(adapters * rank, sum(sorted(layer.ranks, reverse=True)[:adapters]))
            return -(-max(1, most) // 8) * 8

        for layer in self.layers.values():
            p = layer.packs.get(slots, layer.pack)
            layer.fixed = _Packed(*_padded(p.A, p.B, p.col_slot, width(layer), layer.fixed), p.key)
        for group in self.groups:  # the layers' A side by side, each padded as the layer's own pack
            p, parts, start, layers = group.packs.get(slots, group.pack), [], 0, group.layers
            for layer in layers:
                cols, n = p.columns[id(layer)], len(layer.fixed.col_slot)
                parts.append(torch.nn.functional.pad(p.A[:, cols], (0, n - (cols.stop - cols.start))))
                layer.fixed = layer.fixed._replace(columns=slice(start, start + n))
                start += n
            A = _fixed(group.fixed and group.fixed.A, torch.cat(parts, dim=1))
            col_slot = torch.cat([layer.fixed.col_slot for layer in layers])
            col_slot = _fixed(group.fixed and group.fixed.col_slot, col_slot)
            group.fixed = _Packed(A, None, col_slot, p.key)

    def check_finite(self, adapters) -> None:
        """A ValueError if one of ``adapters`` has a value that is not finite (NaN or Inf) in its
        stacks: its rows' outputs would be undefined (other rows' never are: lora_layer.packed_shrink)."""
        for layer in self.layers.values():
            for slot in layer.nonfinite:
                if self.adapter_names[slot] in adapters:
                    raise ValueError(f"Adapter {self.adapter_names[slot]!r} has weights or a scaling that are not "
                                     "finite (NaN or Inf, or B * scaling overflows), so its outputs are undefined; "
                                     "fix or remove it.")

    def max_rank(self, slots) -> int:
        """The largest rank of these slots' adapters over all layers."""
        return max((layer.ranks[s] for layer in self.layers.values() for s in slots), default=0)

    def slots(self, adapter_names) -> torch.LongTensor:
        """[B] slot of each row's adapter; "__base__" -> -1 (no LoRA). Names are validated by the caller."""
        index = {a: i for i, a in enumerate(self.adapter_names)}
        return torch.tensor([index.get(a, -1) for a in adapter_names], dtype=torch.long, device=self.device)

    def begin_pass(self) -> None:
        """A new pass: nothing to share with the last one (a group's kept shrink). A compiled pass
        also guards on what it finds here: it must always find the same, nothing."""
        for group in self.groups:
            group.clear()

    def meta_for(self, adapters, tokens: int, lens=None):
        """Metadata for a layer input of ``tokens`` tokens (rows x tokens per row: the lm_head sees
        fewer per row than the other layers; a ragged pass's real tokens: ``lens[b]`` of row b).
        ``adapters``: the pass context's: the rows' slots [B] (metadata built once per slot tensor
        and width: a decoding loop alternates a few widths, and building reads counts back to the
        host, a device sync on CUDA), or {tokens: LoraMeta} as given (compiled passes)."""
        if isinstance(adapters, dict):
            return adapters.get(tokens)
        if self._memo_rows is not adapters:
            self._memo_rows, self._memo = adapters, {}
        memo = self._memo
        if lens is not None:  # a ragged pass's: kept for that pass only (its lens tensor)
            if self._ragged[0] is not lens or self._ragged[1] is not adapters:
                self._ragged = (lens, adapters, {})
            memo = self._ragged[2]
        meta = memo.get(tokens)
        if meta is None:
            rows = adapters.shape[0]
            if lens is not None:
                slots = torch.as_tensor(adapters, device=self.device).repeat_interleave(lens.to(self.device))
            elif tokens % rows:
                raise ValueError(f"a LoRA layer got {tokens} tokens for {rows} rows: its input is not the batch's "
                                 "tokens (e.g. LoRA on MoE experts, which see routed tokens); not supported")
            else:
                slots = self.token_slots(adapters, tokens // rows)
            meta = memo[tokens] = make_meta(slots, len(self.adapter_names), previous=self._last_meta)
        if not meta.no_lora:
            self._last_meta = meta
        return meta

    def token_slots(self, row_slots, tokens_per_row: int) -> torch.Tensor:
        """[B * tokens_per_row] slot of each token of a [B, tokens_per_row] input."""
        return torch.as_tensor(row_slots, device=self.device).repeat_interleave(tokens_per_row)

    @contextlib.contextmanager
    def installed(self, context, round_delta: bool = True):
        """Route every LoRA layer's forward through lora_layer.forward (base_layer(x) + the delta
        from these stacks) in ``context``'s passes (context.py); restore on exit. ``round_delta``:
        PEFT's mixed-batch numerics (adapter_names=), else its one-adapter numerics (the module
        docstring)."""
        self.context, self.round_delta = context, round_delta
        try:
            with context.router.routing({m: (ALL, self._routes[m]) for _, m in self.modules}):
                yield self
        finally:
            self.context = None
            self.begin_pass()  # drop the references to the last inputs


def get_bank(model, adapters=None, check: SourceCheck | None = None) -> AdapterBank:
    """The model's adapter bank, built on first use and kept in the model's state; synced every call
    (``adapters``: the weights of these adapters only; see AdapterBank.sync)."""
    state = state_of(model)
    if state.bank is None:
        state.bank = AdapterBank(model, check)
    else:
        state.bank.sync(adapters, check)
    return state.bank
