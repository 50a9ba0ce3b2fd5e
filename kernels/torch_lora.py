"""Batched multi-LoRA ops in plain torch: the CPU path, and the fallback wherever Triton cannot run.

On a CPU the LoRA arithmetic of a decode step is tiny; what costs is the number of ops per layer
(about 210 LoRA layers per step) and reading each active adapter's weights. So each op is a
handful of large calls: gather the LoRA tokens (sorted by slot) once, one grouped matmul over the
active slots (torch._grouped_mm, a C++ loop over segments), and one scatter-add back. The active
slots' weights are copied once into the layout grouped_mm wants and cached in the metadata for as
long as the active set stays the same, so a decode loop pays the copy once, not once per step.
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


def _grouped_weight(W: torch.Tensor, meta):
    """W [S, N, K] -> (W[active].transpose(1, 2) as a contiguous [n_active, K, N], whether
    grouped_mm can take it), cached: a decode loop pays the copy and the checks once."""
    hit = meta.cache.get(id(W))
    if hit is None or hit[0] is not W:  # the identity check guards against a recycled id()
        w = W.index_select(0, meta.active).transpose(1, 2).contiguous()
        grouped = _HAS_GROUPED_MM and w.device.type == "cpu" and w.dtype in _GROUPED_MM_DTYPES and _aligned(w)
        hit = meta.cache[id(W)] = (W, w, grouped)
    return hit[1], hit[2]


def _segment_mm(a: torch.Tensor, W: torch.Tensor, meta) -> torch.Tensor:
    """Semantics:
        g-th segment of rows (meta.active_counts[g] of them, in order): out[seg] = a[seg] @ W[active[g]].T
    a: [n, K] (n = num_lora_tokens); W: [S, N, K] -> out [n, N].
    """
    w, grouped = _grouped_weight(W, meta)
    if grouped and _aligned(a):
        return torch._grouped_mm(a, w, offs=meta.offsets)
    # float64, odd strides, other devices: a loop over the active slots only.
    out = a.new_empty(a.shape[0], w.shape[2])
    start = 0
    for g, count in enumerate(meta.active_counts):
        torch.mm(a[start : start + count], w[g], out=out[start : start + count])
        start += count
    return out


def lora_shrink(x: torch.Tensor, A: torch.Tensor, meta, scale: float = 1.0) -> torch.Tensor:
    """Semantics:
        for i in range(n):                       # n = meta.num_lora_tokens
            t = meta.sorted_tokens[i]
            y[i] = scale * x[t] @ A[meta.token_slots[t]].T
    x: [T, H]; A: [S, R, H] -> y: [n, R] in x's dtype (matmul accumulates in fp32 or wider).
    """
    if meta.no_lora:
        return x.new_empty(0, A.shape[1])
    if meta.lora_range is not None:
        xs = x[meta.lora_range[0] : meta.lora_range[1]]
    else:
        xs = x.index_select(0, meta.sorted_tokens[: meta.num_lora_tokens])
    y = _segment_mm(xs, A, meta)
    return y if scale == 1.0 else y.mul_(scale)


def lora_expand(out: torch.Tensor, y: torch.Tensor, B: torch.Tensor, meta) -> None:
    """Semantics:
        for i in range(n):                       # n = meta.num_lora_tokens
            t = meta.sorted_tokens[i]
            out[t] += y[i] @ B[meta.token_slots[t]].T
    out: [T, O] (updated in place); y: [n, R] from lora_shrink (B's dtype); B: [S, O, R].
    """
    if meta.no_lora:
        return
    delta = _segment_mm(y, B, meta)
    if meta.lora_range is not None:
        out[meta.lora_range[0] : meta.lora_range[1]].add_(delta)  # not +=, which copies the slice back
    else:
        out.index_add_(0, meta.sorted_tokens[: meta.num_lora_tokens], delta)
