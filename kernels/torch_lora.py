"""Batched multi-LoRA ops in plain torch: the CPU path, and the fallback wherever Triton cannot run.

On a CPU the LoRA arithmetic of a decode step is tiny; what costs is the number of ops per layer
(about 210 LoRA layers per step) and reading each active adapter's weights. So each op is a
handful of large calls, the same number whatever the number of adapters:

- one adapter on a contiguous run of tokens (a batch of one, or every row on one adapter): a
  matmul on that slice of x, and an addmm into that slice of out;
- otherwise, decode steps: the LoRA tokens gathered into a padded [G, width, H] block (one row of
  blocks per active slot, the metadata's padded layout), one batched matmul per op, one scatter-add
  back (padding rows are zeroed and add nothing);
- prefills, whose tokens spread unevenly: one grouped matmul over the segments of sorted tokens
  (torch._grouped_mm, a C++ loop over them).

The active slots' weights are copied once into the layout the matmuls read fastest and cached in
the metadata for as long as the active set stays the same: a decode loop pays the copy once.
"""

import torch


def _probe_grouped_mm() -> bool:
    # torch._grouped_mm is private and CPU support is recent: use it only if it works here.
    try:
        a, w = torch.ones(2, 8), torch.ones(1, 8, 4)
        return bool((torch._grouped_mm(a, w, offs=torch.tensor([2], dtype=torch.int32)) == 8).all())
    except (AttributeError, RuntimeError, TypeError):
        return False


_HAS_GROUPED_MM = _probe_grouped_mm()
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor) -> bool:
    # grouped_mm wants 16-byte aligned data and every non-unit stride a multiple of 16 bytes.
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride() if s != 1)


def _prepared(W: torch.Tensor, meta) -> torch.Tensor:
    """W [S, N, K] -> W[meta.active] as [G, K, N] contiguous (what x @ W[s].T reads fastest), cached
    in the metadata: a decode loop pays the copy once."""
    hit = meta.cache.get(id(W))
    if hit is None or hit[0] is not W:  # the identity check guards against a recycled id()
        hit = meta.cache[id(W)] = (W, W.transpose(1, 2).index_select(0, meta.active).contiguous())
    return hit[1]


def _segment_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, bounds: list | None = None) -> torch.Tensor:
    """Semantics:
        for g in range(G): out[offs[g-1]:offs[g]] = a[offs[g-1]:offs[g]] @ w[g]       (offs[-1] = 0)
        out[offs[G-1]:] = 0
    a: [n, K]; w: [G, K, N] (any strides); offs: [G] int32, cumulative -> out [n, N].
    bounds: offs as a host list when the caller has it (else read here).
    """
    bounds = offs.tolist() if bounds is None else bounds
    segments = [(g, lo, hi) for g, (lo, hi) in enumerate(zip([0] + bounds[:-1], bounds)) if hi > lo]
    full = len(segments) == len(bounds) and bounds[-1] == a.shape[0]
    if full and _HAS_GROUPED_MM and a.device.type == "cpu" and a.dtype in _GROUPED_MM_DTYPES and _aligned(a) and _aligned(w):
        return torch._grouped_mm(a, w, offs=offs)
    # Empty segments (grouped_mm would still pay a matmul for each), float64, odd strides, other devices.
    out = a.new_zeros(a.shape[0], w.shape[2])
    for g, lo, hi in segments:
        torch.mm(a[lo:hi], w[g], out=out[lo:hi])
    return out


# Compiled passes on the CPU use the adapter bank's packed path with fixed-width packs (bank.py),
# not these ops: static metadata is for the Triton kernels (CUDA graphs).
_STATIC = "the torch path takes no static metadata (make_meta(static=True)): it is for the Triton kernels"


def lora_shrink(x: torch.Tensor, A: torch.Tensor, meta, scale: float = 1.0) -> torch.Tensor:
    """Semantics:
        for i in range(n):                       # n = meta.num_lora_tokens
            t = meta.sorted_tokens[i]
            y[i] = scale * x[t] @ A[meta.token_slots[t]].T
    x: [T, H]; A: [S, R, H] -> y in x's dtype (matmul accumulates in fp32 or wider): [n, R], or, in
    the metadata's padded layout, [G, width, R] (y[g, i] = the i-th token of active slot g; 0 for
    padding). lora_expand takes either.
    """
    if meta.static:
        raise ValueError(_STATIC)
    if meta.no_lora:
        return x.new_empty(0, A.shape[1])
    At = _prepared(A, meta)
    if meta.lora_range is not None and At.shape[0] == 1:  # one adapter, contiguous tokens
        y = x[meta.lora_range[0] : meta.lora_range[1]] @ At[0]
    elif meta.pad_index is not None:
        g, width = meta.pad_mask.shape[:2]
        y = torch.bmm(x.index_select(0, meta.pad_index).view(g, width, -1), At)
        # Padding rows add nothing in lora_expand: set to 0, not multiplied by 0 (token 0 read through
        # another slot's A can be Inf or NaN, which a product by 0 would carry into token 0's output).
        y.masked_fill_(~meta.pad_mask, 0)
    else:
        xs = x[meta.lora_range[0] : meta.lora_range[1]] if meta.lora_range is not None else \
            x.index_select(0, meta.sorted_tokens[: meta.num_lora_tokens])
        y = _segment_mm(xs, At, meta.offsets, meta.bounds)
    return y if scale == 1.0 else y.mul_(scale)


def lora_expand(out: torch.Tensor, y: torch.Tensor, B: torch.Tensor, meta, round_delta: bool = True) -> None:
    """Semantics:
        for i in range(n):                       # n = meta.num_lora_tokens
            t = meta.sorted_tokens[i]
            delta = y[i] @ B[meta.token_slots[t]].T                      # in B's dtype
            out[t] = out[t] + delta.to(out.dtype)     if round_delta     # PEFT, mixed batch
                     (out[t].to(B.dtype) + delta).to(out.dtype) else    # PEFT, one adapter
    out: [T, O] (updated in place); y: lora_shrink's output (B's dtype); B: [S, O, R].
    """
    if meta.static:
        raise ValueError(_STATIC)
    if meta.no_lora:
        return
    Bt = _prepared(B, meta)
    if y.dim() == 3:  # the padded layout: padding rows of y are 0, so they add 0 to token 0
        delta = torch.bmm(y, Bt).view(-1, Bt.shape[2])
        if round_delta or delta.dtype == out.dtype:
            out.index_add_(0, meta.pad_index, delta.to(out.dtype))
            return
        delta = delta.index_select(0, meta.pad_positions)
    else:
        delta = y @ Bt[0] if Bt.shape[0] == 1 else _segment_mm(y, Bt, meta.offsets, meta.bounds)
        if meta.lora_range is not None:  # the LoRA tokens are one slice of out
            rows = out[meta.lora_range[0] : meta.lora_range[1]]
            if round_delta or delta.dtype == out.dtype:
                rows.add_(delta.to(out.dtype))  # not +=, which copies the slice back
            else:
                rows.copy_(rows.to(delta.dtype) + delta)
            return
    idx = meta.sorted_tokens[: meta.num_lora_tokens]
    if round_delta or delta.dtype == out.dtype:
        out.index_add_(0, idx, delta.to(out.dtype))
    else:
        out.index_copy_(0, idx, (out.index_select(0, idx).to(delta.dtype) + delta).to(out.dtype))
