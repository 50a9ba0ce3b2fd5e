"""The adapter bank: every adapter's LoRA weights stacked per layer in fixed slots, and the
per-forward metadata that lets one batched op per layer replace PEFT's loop over adapters.

    bank = get_bank(peft_model)                      # built once, re-synced cheaply per call
    row_slots = bank.slots(["math", "__base__", "code"])
    with bank.installed():
        bank.set_batch(row_slots, tokens_per_row=1)  # once per forward, shared by all layers
        logits = peft_model(input_ids).logits
"""

import contextlib

import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraLayer

from . import kernels

BASE = "__base__"
_BANK_ATTR = "_invisiblelora_bank"
# Sibling LoRA layers that read the same input tensor in the architectures we know. Their shrinks
# become one matmul over the concatenated A (measured on the CPU: one shrink for q/k/v costs
# 40-45% of three separate ones). Only used when the siblings really get the same tensor.
SHARED_INPUT = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})


def _check_layer(name, m):
    """Raise a ValueError naming what the bank cannot represent in this LoRA layer."""
    if type(m) is not LoraLinear:
        raise ValueError(
            f"LoRA layer {name!r} is a {type(m).__module__}.{type(m).__name__}: the adapter bank supports only "
            "peft.tuners.lora.layer.Linear (no Embedding/Conv/quantized LoRA layers)"
        )
    if m.merged:
        raise ValueError(f"LoRA layer {name!r} has merged adapters {m.merged_adapters}: unmerge them first")
    for a in m.lora_A:
        if a in m.lora_variant:
            raise ValueError(
                f"adapter {a!r} in layer {name!r} uses a LoRA variant ({type(m.lora_variant[a]).__name__}, "
                "e.g. DoRA): not supported by the adapter bank"
            )
        if m.lora_bias.get(a, False):
            raise ValueError(f"adapter {a!r} in layer {name!r} has lora_bias=True: not supported by the adapter bank")


def _laid_out(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``t`` [S, M, N] with the same values, stored as [S, N, M] if ``transposed`` (a view of it)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if transposed else t.contiguous()


class _Layer:
    """One LoRA layer's stacked weights: A [S, R, in], B*scaling [S, out, R] (zeros where absent).
    R is the largest rank rounded up to a multiple of 4 (aligned slices for grouped matmuls).
    ``transposed``: store them as [S, in, R] and [S, R, out], the layout the torch path's matmuls
    read fastest (x @ A[s].T); the Triton kernels take either through strides."""

    def __init__(self, m, names, transposed: bool):
        weight = m.get_base_layer().weight
        ranks = {a: m.lora_A[a].weight.shape[0] for a in m.lora_A}
        r_max = -(-max(ranks.values()) // 4) * 4
        like = dict(dtype=weight.dtype, device=weight.device)
        self.A = _laid_out(torch.zeros(len(names), r_max, m.in_features, **like), transposed)
        self.B = _laid_out(torch.zeros(len(names), m.out_features, r_max, **like), transposed)
        with torch.no_grad():
            for slot, a in enumerate(names):
                if a in ranks:
                    self.A[slot, : ranks[a]] = m.lora_A[a].weight
                    # Scale in the adapter's own dtype before casting (fp32 adapters on a bf16 model).
                    self.B[slot, :, : ranks[a]] = m.lora_B[a].weight * m.scaling[a]
        self.group, self.cols = None, (0, r_max)


class _Group:
    """LoRA layers fed the same input: their A stacked along the rank axis for one shared shrink.
    The last shrink's result is kept for the siblings, keyed by the input tensor and metadata."""

    def __init__(self, layers, transposed: bool):
        self.A = _laid_out(torch.cat([layer.A for layer in layers], dim=1), transposed)
        start = 0
        for layer in layers:
            r = layer.A.shape[1]
            # A persistent view: the torch path caches prepared weights by tensor identity.
            layer.A, layer.cols, layer.group = self.A[:, start : start + r], (start, start + r), self
            start += r
        self.clear()

    def clear(self):
        self.x = self.version = self.meta = self.y = None


class AdapterBank:
    """Every adapter's LoRA weights of a PEFT model, stacked per LoRA layer in fixed slots."""

    def __init__(self, model):
        self.model = model
        self._signature = None
        self.version = 0  # bumped on every rebuild of the stacks
        self._meta = None  # metadata of the next forward; None = no LoRA
        self._last_meta = None  # last LoRA metadata: its weight cache outlives draft passes
        self._memo_rows, self._memo = None, {}  # metadata per tokens_per_row for the current row_slots
        self.sync()

    def _current_signature(self):
        # What a rebuild depends on: the LoRA modules, adapter names, ranks, scalings and the
        # identity and in-place version of every LoRA weight. ~10k cheap attribute reads for 64
        # adapters on a 30-layer model, once per generate call.
        sig = []
        for _, m in self._lora_modules():
            sig.append((id(m), m.merged, tuple(m.lora_variant), tuple(k for k, v in m.lora_bias.items() if v)))
            for a, lin in m.lora_A.items():
                wa, wb = lin.weight, m.lora_B[a].weight
                sig.append((a, m.scaling[a], id(wa), wa._version, id(wb), wb._version))
        return tuple(sig)

    def _lora_modules(self):
        return [(n, m) for n, m in self.model.named_modules() if isinstance(m, LoraLayer)]

    def sync(self) -> None:
        """Rebuild the stacks if adapters were added or deleted, rescaled or changed in place."""
        signature = self._current_signature()
        if signature == self._signature:
            return
        self.modules = self._lora_modules()
        if not self.modules:
            raise ValueError("no PEFT LoRA layers found in the model")
        for name, m in self.modules:
            _check_layer(name, m)
        names = list(dict.fromkeys(a for _, m in self.modules for a in m.lora_A))
        if BASE in names:
            raise ValueError(f"an adapter may not be named {BASE!r}: PEFT uses it for 'no adapter'")
        self.adapter_names = names
        weight = self.modules[0][1].get_base_layer().weight
        self.device = weight.device
        self.ops = kernels.get_backend(self.device, weight.dtype)
        transposed = self.ops is kernels.torch_lora
        self.layers = {m: _Layer(m, names, transposed) for _, m in self.modules if len(m.lora_A)}
        self.groups = self._make_groups(transposed)
        # One wrapper per layer for the bank's lifetime: compiled graphs guard on the forward they traced.
        self._forwards = {
            m: (lambda x, *args, _m=m, _layer=self.layers.get(m), **kwargs: self._forward(_m, _layer, x, *args, **kwargs))
            for _, m in self.modules
        }
        self._signature = signature
        self.version += 1
        self._meta = self._last_meta = None  # their weight caches refer to the old stacks
        self._memo_rows, self._memo = None, {}

    def _make_groups(self, transposed: bool):
        siblings = {}
        for name, m in self.modules:
            parent, _, leaf = name.rpartition(".")
            kind = next((i for i, leaves in enumerate(SHARED_INPUT) if leaf in leaves), None)
            if m in self.layers and kind is not None:
                siblings.setdefault((parent, kind, m.in_features), []).append(self.layers[m])
        return [_Group(layers, transposed) for layers in siblings.values() if len(layers) > 1]

    def _shrink(self, layer, x, x2, meta):
        group = layer.group
        if group is None:
            return self.ops.lora_shrink(x2, layer.A, meta)
        # Under torch.compile the graph is traced once with fixed inputs; tensor versions are not traceable.
        version = None if torch.compiler.is_compiling() else x._version
        if not (group.x is x and group.version == version and group.meta is meta):
            group.x, group.version, group.meta = x, version, meta
            group.y = self.ops.lora_shrink(x2, group.A, meta)
        return group.y[:, layer.cols[0] : layer.cols[1]]

    def slots(self, adapter_names) -> torch.LongTensor:
        """[B] slot of each row's adapter; "__base__" -> -1 (no LoRA)."""
        index = {a: i for i, a in enumerate(self.adapter_names)}
        unknown = sorted({a for a in adapter_names if a != BASE and a not in index})
        if unknown:
            raise ValueError(f"unknown adapter(s) {unknown}; loaded adapters: {self.adapter_names} (or {BASE!r})")
        return torch.tensor([index.get(a, -1) for a in adapter_names], dtype=torch.long, device=self.device)

    def set_batch(self, row_slots, tokens_per_row: int) -> None:
        """Metadata for the next forward(s): x is [B, tokens_per_row, H] and row r uses slot
        row_slots[r] for all its tokens. row_slots=None: no LoRA at all (base model cost).
        Metadata is memoized per row_slots object: pass a new tensor rather than editing one in place."""
        if row_slots is None:
            self.set_meta(None)
            return
        # A decoding loop alternates a few (row_slots, tokens_per_row) pairs: build each metadata once
        # per call (building reads counts back to the host: a device sync on CUDA).
        if self._memo_rows is not row_slots:
            self._memo_rows, self._memo = row_slots, {}
        meta = self._memo.get(tokens_per_row)
        if meta is None:
            meta = self._memo[tokens_per_row] = kernels.make_meta(
                self.token_slots(row_slots, tokens_per_row), len(self.adapter_names), previous=self._last_meta
            )
        self.set_meta(meta)
        if not meta.no_lora:
            self._last_meta = meta

    def token_slots(self, row_slots, tokens_per_row: int) -> torch.Tensor:
        """[B * tokens_per_row] slot of each token of a [B, tokens_per_row] input."""
        return torch.as_tensor(row_slots, device=self.device).repeat_interleave(tokens_per_row)

    def set_meta(self, meta) -> None:
        """Metadata of the next forward(s) as given (kernels.LoraMeta; None = no LoRA)."""
        self._meta = meta
        # A new pass: nothing to share with the last one. (A compiled pass also guards on what it
        # finds here: it must always find the same, nothing.)
        for group in self.groups:
            group.clear()

    def _forward(self, m, layer, x, *args, **kwargs):
        # PEFT's generate() hooks inject adapter_names into every LoRA layer; under installed()
        # the rows' adapters come from set_batch instead.
        kwargs.pop("adapter_names", None)
        out = m.base_layer(x, *args, **kwargs)
        meta = self._meta
        if meta is None or meta.no_lora or layer is None or m._disable_adapters:
            return out
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] != meta.token_slots.shape[0]:
            raise ValueError(
                f"set_batch described {meta.token_slots.shape[0]} tokens but a LoRA layer got {x2.shape[0]}"
            )
        y = self._shrink(layer, x, x2, meta)
        self.ops.lora_expand(out.view(-1, out.shape[-1]), y, layer.B, meta)
        return out

    @contextlib.contextmanager
    def installed(self):
        """Route every LoRA layer's forward through base_layer(x) + bank delta; restore on exit."""
        saved = []
        try:
            for _, m in self.modules:
                saved.append((m, m.__dict__.get("forward")))
                m.forward = self._forwards[m]
            yield self
        finally:
            for m, previous in saved:
                if previous is None:
                    del m.forward
                else:
                    m.forward = previous
            self._meta = None
            for group in self.groups:
                group.clear()  # drop the references to the last inputs


def get_bank(model) -> AdapterBank:
    """The model's adapter bank, built on first use and cached on the model; synced every call."""
    bank = model.__dict__.get(_BANK_ATTR)
    if bank is None:
        bank = AdapterBank(model)
        model.__dict__[_BANK_ATTR] = bank
    else:
        bank.sync()
    return bank
