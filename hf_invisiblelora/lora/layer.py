"""What a LoRA layer computes in a LoRA-on pass: its base output plus each token's delta from the
adapter bank's stacks (bank.py holds the weights and the per-pass metadata; this module reads them).

    out = base_layer(x)
    out += delta                      # the packed path (torch, decode-sized inputs) or the
                                      # gathered shrink / expand kernels (kernels/)
    DoRA slots: out scaled per column; embedding LoRA: PEFT's term per adapter's tokens

Numerics are PEFT's (see bank.py's docstring): the delta rounded to the output's dtype first for a
mixed batch, summed in the adapters' dtype for one adapter.
"""

import torch
from peft.tuners.lora.layer import Embedding as LoraEmbedding
from torch import nn

from ..kernels import torch_lora
from ..model.context import real_tokens

# The packed path (packed_delta) multiplies every token by every active adapter: it is used while
# tokens x (active adapters - 1), the wasted rows, stay under this. Measured on SmolLM2 with its
# zoo (2 CPU threads): faster than the gathered path everywhere below it, even at 512 prefill
# tokens on 12 adapters (a tie there).
PACKED_WASTE = 4096


def forward(bank, m, layer, x, *args, **kwargs):
    """LoRA layer ``m``'s output for ``x`` in the pass of ``bank.context`` (``layer``: its stacks,
    None for an embedding or a layer without adapters)."""
    p = bank.context
    # PEFT's generate() hooks inject adapter_names into every LoRA layer; under installed()
    # the rows' adapters come from the pass context instead.
    kwargs.pop("adapter_names", None)
    base = m.base_layer
    if args or kwargs or type(base) is not nn.Linear or base._forward_hooks or base._forward_pre_hooks \
            or not p.router.runs_as_is(base, p.drafter):
        out = base(x, *args, **kwargs)
    else:  # a plain Linear: skip the module call (about 210 of these per step); a torchao weight computes F.linear
        out = nn.functional.linear(x, base.weight, base.bias)
    if p.drafter is not None or p.adapters is None or m.disable_adapters:
        return out  # no LoRA here: a draft pass, or PEFT's adapters disabled
    embedding = layer is None and isinstance(m, LoraEmbedding)  # its input is token ids
    if layer is None and not embedding:
        return out  # no adapter in this layer
    # Tokens in row order: row b's tokens are consecutive (a ragged pass: its real tokens only).
    real = real_tokens(p, x)
    x2 = x[real] if real is not None else x.reshape(-1) if embedding else x.reshape(-1, x.shape[-1])
    meta = bank.meta_for(p.adapters, x2.shape[0], None if real is None else p.lens)
    if meta is None or meta.no_lora:
        return out
    if not embedding and not meta.static and layer.live.isdisjoint(meta.active_slots):
        return out  # none of the pass's adapters has weights here (a model holds more adapters than a pass uses)
    if real is not None:  # the delta of the real tokens, then back in their places
        flat = out[real]
        _add_delta(bank, m, layer, x, x2, flat, meta, embedding)
        out[real] = flat
        return out
    _add_delta(bank, m, layer, x, x2, out.view(-1, out.shape[-1]), meta, embedding)
    return out


def _add_delta(bank, m, layer, x, x2, flat, meta, embedding: bool) -> None:
    """flat [T, out] (the base output of the tokens x2) += their LoRA terms (DoRA: PEFT's result)."""
    if embedding:
        embedding_delta(bank.adapter_names, m, x2, flat, meta)
        return
    x2 = x2 if x2.dtype == bank.dtype else x2.to(bank.dtype)
    dora = bool(layer.dora) and (meta.static or not layer.dora.isdisjoint(meta.active_slots))
    round_delta = bank.round_delta or layer.rounds
    # DoRA scales the base output too: the delta apart first, in the adapters' dtype.
    delta = torch.zeros(flat.shape, dtype=bank.dtype, device=flat.device) if dora else flat
    if bank.ops is torch_lora and \
            (meta.static or x2.shape[0] * (len(meta.active_slots) - 1) <= PACKED_WASTE):
        packed_delta(layer, x, x2, delta, meta, round_delta)
    else:
        y = shrink(bank.ops, layer, x, x2, meta)
        bank.ops.lora_expand(delta, y, layer.B, meta, round_delta=round_delta)
    if dora:
        dora_result(layer, flat, delta, meta, bank.round_delta)


def shared(group, x, meta, compute):
    """The group's shrink for input ``x``: computed by its first layer, reused by its siblings."""
    # Under torch.compile the graph is traced once with fixed inputs; tensor versions are not
    # traceable, and inference tensors have none.
    version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
    if not (group.x is x and group.version == version and group.meta is meta):
        group.x, group.version, group.meta = x, version, meta
        group.y = compute()
    return group.y


def shrink(ops, layer, x, x2, meta):
    """The gathered shrink of ``layer``'s slots (its group's, shared, when it has one)."""
    group = layer.group
    if group is None:
        return ops.lora_shrink(x2, layer.A, meta)
    y = shared(group, x, meta, lambda: ops.lora_shrink(x2, group.A, meta))
    return y[..., layer.cols[0] : layer.cols[1]]


def packed_delta(layer, x, x2, out, meta, round_delta: bool) -> None:
    """out += each token's LoRA delta from the active slots' packed weights (stacks.Packed):
    y = (x @ A) masked to the columns of the token's own slot; out += y @ B. Three ops per layer
    whatever the number of adapters, and each active adapter's weights read once at its rank.
    Its arithmetic grows with tokens x active ranks: for the few tokens of decode steps.
    Static metadata (a compiled pass): the fixed packs of ``AdapterBank.fix``."""
    group = layer.group
    if meta.static:
        own, packed = layer.fixed, group and group.fixed
        columns = own.columns
    else:
        slots = meta.active_slots
        own, packed = layer.packs.get(slots, layer.pack), group and group.packs.get(slots, group.pack)
        columns = packed and packed.columns[id(layer)]
    B = own.B
    if group is None:
        y = packed_shrink(x2, own, meta)
    else:
        y = shared(group, x, meta, lambda: packed_shrink(x2, packed, meta))[:, columns]
    if round_delta or out.dtype == B.dtype:
        out.addmm_(y, B) if out.dtype == B.dtype else out.add_((y @ B).to(out.dtype))
    else:  # PEFT's one-adapter numerics: the sum in the adapter's dtype (rows without LoRA add an exact 0)
        out.copy_((out.to(B.dtype) + y @ B).to(out.dtype))


def packed_shrink(x, packed, meta):
    """x @ packed.A, each token's row zero outside its own slot's columns. Set to zero, not
    multiplied by a 0/1 mask: a token's product with another slot's A may overflow to Inf (or
    be NaN), and Inf * 0 is NaN; zeros then add exact zeros through the finite B of the other
    slots (the bank refuses slots that are not finite), so a row never computes with another
    row's adapter values."""
    y = x @ packed.A
    if meta.static:  # computed in the graph: its inputs are updated in place between calls
        return torch.where(meta.token_slots[:, None] == packed.col_slot, y, 0)
    if len(meta.active_slots) == 1 and meta.lora_range == (0, y.shape[0]):
        return y  # every token on the one active slot
    foreign = meta.masks.get(packed.key)
    if foreign is None:
        foreign = meta.masks[packed.key] = meta.token_slots[:, None] != packed.col_slot
    return y.masked_fill_(foreign, 0)


def dora_result(layer, out, delta, meta, round_delta: bool) -> None:
    """``out`` (the base output, [T, out]) becomes PEFT's DoRA result for each token on a DoRA slot:
    out + ((scale - 1) * (out - bias) + scale * delta), the sum in the adapters' dtype rounded once,
    with adapter_names or without; out + delta for the others (their scale is 1), rounded as the
    bank adds a delta (bank.py's docstring)."""
    bias = layer.module.get_base_layer().bias
    scale = layer.scale[meta.token_slots]  # slot -1 (no LoRA) reads the last row: ones
    base = out if bias is None else out - bias  # in the output's dtype, as PEFT subtracts it
    result = out + ((scale - 1) * base + scale * delta)
    if round_delta and out.dtype != delta.dtype:  # the plain-LoRA tokens: the delta rounded first
        result = torch.where(layer.is_dora[meta.token_slots][:, None], result, out + delta.to(out.dtype))
    out.copy_(result)


def embedding_delta(adapter_names, m, ids, out, meta) -> None:
    """out [T, dim] += each token's embedding LoRA term, as PEFT's Embedding computes it in a mixed
    batch: per adapter, its tokens' ids embedded in A.T, @ B.T, * scaling, * the base layer's embed
    scale, added in place. Static metadata (compiled passes): every slot over all tokens, zero off
    its own."""
    embed_scale = m._get_embed_scale()
    if meta.static:
        parts = [(s, None) for s in range(len(adapter_names))]
    else:
        parts = zip(meta.active_slots, [0] + meta.bounds[:-1], meta.bounds)
        parts = [(s, meta.sorted_tokens[lo:hi]) for s, lo, hi in parts]
    for s, tokens in parts:
        a = adapter_names[s]
        if a not in m.lora_embedding_A:
            continue
        after_A = m._embed(ids if tokens is None else ids[tokens], m.lora_embedding_A[a].T)
        term = (after_A @ m.lora_embedding_B[a].T) * m.scaling[a]
        if embed_scale is not None:
            term = term * embed_scale.to(term.dtype)
        if tokens is None:
            out += torch.where((meta.token_slots == s)[:, None], term, 0)
        else:
            out[tokens] += term
