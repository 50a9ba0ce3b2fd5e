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

from .. import tuning
from ..kernels import torch_lora
from ..kernels.meta import make_meta, token_runs
from ..model.context import real_tokens

PATHS = ("packed", "gathered", "runs")  # the torch paths (torch_path)
FORCE_PATH = None  # one of PATHS: every pass on that torch path (tests: each gives PEFT's numbers)
SAMPLE_LAYERS = 7  # the LoRA layers a path choice is timed on (a Llama decoder layer's: whole groups)


def forward(bank, m, layer, x, *args, **kwargs):
    """LoRA layer ``m``'s output for ``x`` in the pass of ``bank.context`` (``layer``: its stacks,
    None for an embedding or a layer without adapters)."""
    p = bank.context
    # PEFT's generate() hooks inject adapter_names into every LoRA layer; under installed()
    # the rows' adapters come from the pass context instead.
    kwargs.pop("adapter_names", None)
    base = m.base_layer
    if args or kwargs or not plain_linear(p.router, base, p.drafter):
        out = base(x, *args, **kwargs)
    else:  # a plain Linear: skip the module call (about 210 of these per step); a torchao weight computes F.linear
        out = nn.functional.linear(x, base.weight, base.bias)
    return add_lora(bank, m, layer, x, out)


def plain_linear(router, base, drafter) -> bool:
    """Whether ``base`` computes F.linear of its weight and bias in a pass of ``drafter``: an nn.Linear
    with no hook and no route of its own there."""
    return unhooked_linear(base) and router.runs_as_is(base, drafter)


def unhooked_linear(base) -> bool:
    return type(base) is nn.Linear and not base._forward_hooks and not base._forward_pre_hooks


def direct(bank, m, router, drafter):
    """x -> ``forward``'s output for LoRA layer ``m`` in a pass of ``drafter``, for the passes run as
    plain functions (model/llama_pass.py, made once per call): a plain Linear base layer's checks made
    and its weight and bias read once per call, not per pass (a call's weights are fixed: derived.py);
    a routed one (a prepacked copy, a drafter's layer) by its route's direct form, without the module
    call. Measured on SmolLM2 (one process, interleaved): LoRA-on passes 1.04-1.07x faster at one row."""
    base = m.base_layer
    if not unhooked_linear(base):
        return lambda x: forward(bank, m, bank.layers.get(m), x)
    if router.runs_as_is(base, drafter):
        weight, bias = base.weight, base.bias
        return lambda x: add_lora(bank, m, bank.layers.get(m), x, nn.functional.linear(x, weight, bias))
    linear = router.direct(base, drafter)
    return lambda x: add_lora(bank, m, bank.layers.get(m), x, linear(x))


def add_lora(bank, m, layer, x, out):
    """``out`` (the base layer's output for ``x``) with the LoRA terms of the pass's rows added (see forward)."""
    p = bank.context
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
    path = "packed" if meta.static else torch_path(bank, meta, x2.shape[0]) if bank.ops is torch_lora else None
    if path == "packed":
        packed_delta(layer, x, x2, delta, meta, round_delta)
    elif path == "runs":
        runs_delta(layer, x, x2, delta, meta, round_delta)
    else:
        y = shrink(bank.ops, layer, x, x2, meta)
        bank.ops.lora_expand(delta, y, layer.B, meta, round_delta=round_delta)
    if dora:
        dora_result(layer, flat, delta, meta, bank.round_delta)


def torch_path(bank, meta, tokens: int) -> str:
    """Which torch path computes a pass of ``tokens`` tokens over ``meta``'s active slots: "packed"
    (packed_delta: every token times every active adapter, three ops per layer whatever their
    number), "gathered" (the shrink / expand ops of kernels/torch_lora.py: each token times its own
    adapter, in grouped or padded matmuls) or "runs" (runs_delta: two matmuls per run of tokens on
    one adapter, at its own rank, on slices of the input and output). Which is faster depends on
    the CPU, the tokens, how many runs they make and the active adapters' ranks (on one Xeon, 2048
    prefill tokens in 8 rows over four adapters of ranks 16-64: runs 0.55x the gathered time,
    packed 1.15x), so it is timed on the bank's own first layers, once per machine for each set of
    ranks, token count and run count (each rounded up to a power of two: tuning.py), and kept on
    the metadata for the pass. One active adapter: packed (nothing is wasted)."""
    if FORCE_PATH is not None:
        return FORCE_PATH
    if meta.path is None:
        meta.path = "packed" if len(meta.active_slots) < 2 else _measured_path(bank, meta, tokens)
    return meta.path


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _measured_path(bank, meta, tokens: int) -> str:
    slots, runs = meta.active_slots, _bucket(len(token_runs(meta)))
    tokens = max(_bucket(tokens), runs)
    sample = [layer for layer in bank.layers.values() if not layer.dora][:SAMPLE_LAYERS]
    key = {"tokens": tokens, "runs": runs,
           "layers": [[layer.module.out_features, layer.module.in_features, [layer.ranks[s] for s in slots]]
                      for layer in sample]}
    return tuning.tuned("lora_path", key, lambda: _time_paths(bank, sample, slots, tokens, runs))["path"]


def _time_paths(bank, sample, slots: tuple, tokens: int, runs: int) -> dict:
    """{"path": the fastest, "ms": each one's time over ``sample``} for ``tokens`` tokens in ``runs``
    runs of equal length, over ``slots`` in turn (the rows of a batch), the packed path the
    reference (tuning.pick)."""
    per = -(-tokens // runs)
    token_slots = torch.tensor(slots, device=bank.device).repeat(-(-runs // len(slots)))[:runs]
    meta = make_meta(token_slots.repeat_interleave(per)[:tokens], len(bank.adapter_names))
    xs = {n: tuning.sample_input(tokens, n, bank.dtype, bank.device) for n in {layer.module.in_features for layer in sample}}
    outs = {layer: torch.zeros(tokens, layer.module.out_features, dtype=bank.dtype, device=bank.device)
            for layer in sample}
    live = [layer for layer in sample if not layer.live.isdisjoint(slots)]

    def clear_groups():  # each run computes its groups' shrinks (a pass recomputes them for its own input)
        for layer in live:
            if layer.group is not None:
                layer.group.clear()

    def run(path: str):
        clear_groups()
        for layer in live:
            x = xs[layer.module.in_features]
            if path == "packed":
                packed_delta(layer, x, x, outs[layer], meta, True)
            elif path == "runs":
                runs_delta(layer, x, x, outs[layer], meta, True)
            else:
                bank.ops.lora_expand(outs[layer], shrink(bank.ops, layer, x, x, meta), layer.B, meta)
        if bank.device.type == "cuda":  # the torch path forced on a GPU: time its work, not its launches
            torch.cuda.synchronize(bank.device)
    with torch.no_grad():
        times = tuning.fastest({path: lambda path=path: run(path) for path in PATHS})
    clear_groups()
    return {"path": tuning.pick(times, "packed"), "ms": {k: round(v * 1e3, 3) for k, v in times.items()}}


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
    if group is None:
        y = packed_shrink(x2, own, meta)
    else:
        y = shared(group, x, meta, lambda: packed_shrink(x2, packed, meta))[:, columns]
    add_product(out, y, own.B, round_delta)


def runs_delta(layer, x, x2, out, meta, round_delta: bool) -> None:
    """out += each token's LoRA delta, run by run (kernels/meta.py's token_runs: a prefill's rows):
    the run's slice of x2 times its adapter's A and B, views of the stacks at the adapter's rank (no
    copies, gathers or masks; a group's shrink shared, as wide as its slot's widest layer). Two
    matmuls per run: for runs of many tokens."""
    group = layer.group
    if group is None:
        ys, start = runs_shrink(x2, layer.A, layer.ranks, meta), 0
    else:
        ys, start = shared(group, x, meta, lambda: runs_shrink(x2, group.A, group.ends, meta)), layer.cols[0]
    for y, (s, lo, hi) in zip(ys, token_runs(meta)):
        r = layer.ranks[s]
        if r:
            add_product(out[lo:hi], y[:, start : start + r], layer.B[s, :, :r].T, round_delta)


def runs_shrink(x2, A, widths, meta) -> list:
    """[x2[lo:hi] @ A[s, :widths[s]].T for each run (s, lo, hi) of token_runs(meta)]"""
    return [x2[lo:hi] @ A[s, : widths[s]].T for s, lo, hi in token_runs(meta)]


def add_product(out, y, B, round_delta: bool) -> None:
    """out += y @ B in place, as PEFT adds a LoRA term: rounded to out's dtype first (``round_delta``:
    a mixed batch), or summed in the adapters' dtype (one adapter; rows without LoRA add an exact 0)."""
    if round_delta or out.dtype == B.dtype:
        out.addmm_(y, B) if out.dtype == B.dtype else out.add_((y @ B).to(out.dtype))
    else:
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
