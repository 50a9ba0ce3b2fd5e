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

import torch

from ..kernels import torch_lora
from ..kernels.meta import get_backend, make_meta
from ..model.derived import SourceCheck
from ..model.routing import ALL
from ..model.state import state_of
from ..model.walk import layer_adapters, named_lora_layers
from . import layer as lora_layer
from .stacks import Group, Packed, Stacks, fixed_into, padded

# Sibling LoRA layers that read the same input tensor in the architectures we know. Their shrinks
# become one matmul over the concatenated A (measured on the CPU: one shrink for q/k/v costs
# 40-45% of three separate ones). Only used when the siblings really get the same tensor.
SHARED_INPUT = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})


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
        self.refresh(adapters, check)

    def refresh(self, adapters, check: SourceCheck) -> None:
        """``sync``'s second half, for a structure already followed with ``check`` (the same call):
        rewrite the slots of ``adapters`` whose sources changed."""
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
        self.layers = {m: Stacks(m, names, dtype, transposed, check) for _, m in self.modules if len(m.lora_A)}
        self.groups = self._make_groups(transposed)
        # One route per layer for the bank's lifetime (routing.py). It reads the layer's stacks when it
        # runs: a rebuild while installed (a call's sync) moves slots and stacks together.
        self._routes = {m: self._route(m) for _, m in self.modules}
        self.version += 1
        self._drop_prepared()

    def _route(self, m):
        def route(original, x, *args, **kwargs):
            return lora_layer.forward(self, m, self.layers.get(m), x, *args, **kwargs)
        route.direct = lambda original, router, drafter: lora_layer.direct(self, m, router, drafter)  # Router.direct's
        return route

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
        return [Group(layers, transposed) for layers in siblings.values() if len(layers) > 1]

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
            layer.fixed = Packed(*padded(p.A, p.B, p.col_slot, width(layer), layer.fixed), p.key)
        for group in self.groups:  # the layers' A side by side, each padded as the layer's own pack
            p, parts, start, layers = group.packs.get(slots, group.pack), [], 0, group.layers
            for layer in layers:
                cols, n = p.columns[id(layer)], len(layer.fixed.col_slot)
                parts.append(torch.nn.functional.pad(p.A[:, cols], (0, n - (cols.stop - cols.start))))
                layer.fixed = layer.fixed._replace(columns=slice(start, start + n))
                start += n
            A = fixed_into(group.fixed and group.fixed.A, torch.cat(parts, dim=1))
            col_slot = torch.cat([layer.fixed.col_slot for layer in layers])
            col_slot = fixed_into(group.fixed and group.fixed.col_slot, col_slot)
            group.fixed = Packed(A, None, col_slot, p.key)

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
