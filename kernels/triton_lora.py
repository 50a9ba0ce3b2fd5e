"""Batched multi-LoRA shrink/expand in Triton (SGMV style: tokens grouped by adapter slot).

Each program handles one tile of one slot's tokens: the grid is (row tiles x column tiles, slots)
and depends only on tensor shapes (T, R or O, S), never on how tokens are spread over slots, so a
CUDA graph can capture it. Programs whose tile lies past their slot's token count return at once.
Accumulation is in fp32; the intermediate y is an fp32 [T, R] buffer (rows >= num_lora_tokens are
not written). Runs on the CPU only under TRITON_INTERPRET=1 (for tests).
"""

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per tile; decode batches are small


def _block(n, lo=16, hi=64):
    return max(lo, min(hi, triton.next_power_of_2(n)))


@triton.jit
def _slot_rows(sorted_tokens, slot_counts, slot_starts, pid_m, slot, BLOCK_M: tl.constexpr):
    """This tile's rows: positions in the slot's segment of the sorted order and their tokens."""
    count = tl.load(slot_counts + slot)
    start = tl.load(slot_starts + slot).to(tl.int64)  # offsets in int64: T x stride can pass 2**31
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < count
    tokens = tl.load(sorted_tokens + start + offs, mask=mask, other=0)
    return start + offs, tokens, mask


@triton.jit
def _shrink_kernel(
    x, w, y, sorted_tokens, slot_counts, slot_starts, scale, H, R,
    stride_xt, stride_xh, stride_ws, stride_wr, stride_wh, stride_yt, stride_yr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """Semantics (one program = BLOCK_M tokens of slot s x BLOCK_N rank columns):
        for i in tile(segment of s): y[i, cols] = scale * sum_k x[sorted_tokens[i], k] * w[s, cols, k]
    """
    slot = tl.program_id(1).to(tl.int64)  # slot * stride can pass 2**31 for large stacks
    n_tiles_n = tl.cdiv(R, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // n_tiles_n, tl.program_id(0) % n_tiles_n
    if pid_m * BLOCK_M >= tl.load(slot_counts + slot):
        return
    pos, tokens, m_mask = _slot_rows(sorted_tokens, slot_counts, slot_starts, pid_m, slot, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        a = tl.load(x + tokens[:, None] * stride_xt + ks[None, :] * stride_xh,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w + slot * stride_ws + cols[None, :] * stride_wr + ks[:, None] * stride_wh,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:  # fp32 inputs: no TF32 rounding
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(y + pos[:, None] * stride_yt + cols[None, :] * stride_yr, acc * scale,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expand_kernel(
    y, w, out, sorted_tokens, slot_counts, slot_starts, R, O,
    stride_yt, stride_yr, stride_ws, stride_wo, stride_wr, stride_ot, stride_oo,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ROUND_DELTA: tl.constexpr,
):
    """Semantics (one program = BLOCK_M tokens of slot s x BLOCK_N output columns):
        for i in tile(segment of s): out[sorted_tokens[i], cols] += sum_r y[i, r] * w[s, cols, r]
    (the sum rounded to out's dtype before the add if ROUND_DELTA, else added in fp32).
    Every (token, column) belongs to exactly one program, so the read-modify-write needs no atomics.
    """
    slot = tl.program_id(1).to(tl.int64)
    n_tiles_n = tl.cdiv(O, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // n_tiles_n, tl.program_id(0) % n_tiles_n
    if pid_m * BLOCK_M >= tl.load(slot_counts + slot):
        return
    pos, tokens, m_mask = _slot_rows(sorted_tokens, slot_counts, slot_starts, pid_m, slot, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < O
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < R
        a = tl.load(y + pos[:, None] * stride_yt + ks[None, :] * stride_yr,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w + slot * stride_ws + cols[None, :] * stride_wo + ks[:, None] * stride_wr,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b.to(tl.float32), input_precision="ieee")
        else:  # half-precision weights: the tensor-core dot wants both operands in their dtype
            acc += tl.dot(a.to(b.dtype), b)
    ptrs = out + tokens[:, None] * stride_ot + cols[None, :] * stride_oo
    mask = m_mask[:, None] & n_mask[None, :]
    if ROUND_DELTA:  # PEFT's mixed batch: the delta in the output's dtype, then added
        new = tl.load(ptrs, mask=mask) + acc.to(out.dtype.element_ty)
    else:  # PEFT with one adapter: added in fp32, then rounded
        new = tl.load(ptrs, mask=mask).to(tl.float32) + acc
    tl.store(ptrs, new.to(out.dtype.element_ty), mask=mask)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtypes(**tensors) -> None:
    """The kernels load their operands as given: refuse dtypes they were not written for, by name."""
    bad = {name: t.dtype for name, t in tensors.items() if t.dtype not in _DTYPES}
    if bad:
        raise TypeError(f"Triton LoRA kernels take float32/float16/bfloat16 tensors, got {bad}")


def lora_shrink(x: torch.Tensor, A: torch.Tensor, meta, scale: float = 1.0) -> torch.Tensor:
    """Semantics:
        for i in range(n):                       # n = meta.num_lora_tokens
            t = meta.sorted_tokens[i]
            y[i] = scale * x[t] @ A[meta.token_slots[t]].T
    x: [T, H]; A: [S, R, H] -> y: [T, R] float32 (rows i >= n unwritten).
    """
    _check_dtypes(x=x, A=A)
    if x.dtype != A.dtype:
        raise TypeError(f"lora_shrink: x is {x.dtype} but A is {A.dtype}; cast x to A's dtype (as PEFT does)")
    T, H = x.shape
    S, R, _ = A.shape
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if meta.no_lora:
        return y
    BLOCK_N, BLOCK_K = _block(R), _block(H)
    grid = (triton.cdiv(T, BLOCK_M) * triton.cdiv(R, BLOCK_N), S)
    _shrink_kernel[grid](
        x, A, y, meta.sorted_tokens, meta.slot_counts, meta.slot_starts, scale, H, R,
        x.stride(0), x.stride(1), A.stride(0), A.stride(1), A.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
    )
    return y


def lora_expand(out: torch.Tensor, y: torch.Tensor, B: torch.Tensor, meta, round_delta: bool = True) -> None:
    """Semantics:
        for i in range(n):                       # n = meta.num_lora_tokens
            t = meta.sorted_tokens[i]
            delta = y[i] @ B[meta.token_slots[t]].T                      # fp32 accumulate
            out[t] = out[t] + delta.to(out.dtype)     if round_delta     # PEFT, mixed batch
                     (out[t].float() + delta).to(out.dtype) else        # PEFT, one adapter
    out: [T, O] (updated in place); y: [T, R] from lora_shrink; B: [S, O, R].
    """
    if meta.no_lora:
        return
    _check_dtypes(out=out, B=B)
    if y.dtype != torch.float32:
        raise TypeError(f"lora_expand: y must be lora_shrink's float32 output, got {y.dtype}")
    T, O = out.shape
    S, _, R = B.shape
    BLOCK_N, BLOCK_K = _block(O), _block(R)
    grid = (triton.cdiv(T, BLOCK_M) * triton.cdiv(O, BLOCK_N), S)
    _expand_kernel[grid](
        y, B, out, meta.sorted_tokens, meta.slot_counts, meta.slot_starts, R, O,
        y.stride(0), y.stride(1), B.stride(0), B.stride(1), B.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=B.dtype == torch.float32,
        ROUND_DELTA=round_delta,
    )
