"""Batched LoRA ops vs the per-adapter reference: torch path on many shapes, Triton under its interpreter."""

import os
import random
import re
import subprocess
import sys

import pytest
import torch

from hf_invisiblelora.kernels import torch_lora
from hf_invisiblelora.kernels.meta import get_backend, make_meta, token_runs
from hf_invisiblelora.kernels.reference import lora_reference

PATTERNS = ["distinct", "uniform", "skewed", "identical", "with_none", "all_none", "sorted_rows"]


def token_slots_for(pattern, T, S, rng):
    if pattern == "distinct":  # as many different adapters as possible
        slots = [i % S for i in range(T)]
        rng.shuffle(slots)
    elif pattern == "uniform":
        slots = [rng.randrange(S) for _ in range(T)]
    elif pattern == "skewed":  # zipf-like popularity
        weights = [1 / (i + 1) ** 1.5 for i in range(S)]
        slots = rng.choices(range(S), weights, k=T)
    elif pattern == "identical":
        slots = [rng.randrange(S)] * T
    elif pattern == "with_none":
        slots = [rng.randrange(-1, S) for _ in range(T)]
    elif pattern == "all_none":
        slots = [-1] * T
    else:  # rows already grouped by adapter, no-LoRA rows last: the torch path slices, no gather
        slots = sorted(rng.randrange(S) for _ in range(T - T // 4)) + [-1] * (T // 4)
    return torch.tensor(slots)


def make_case(seed, dtype, max_t=40, max_h=300, max_r=64, max_s=32, align=1):
    """Random shapes; every slot has its own rank (zero-padded to the max, as in the bank).
    align: round H, O and the padded rank up to a multiple (model-like, aligned strides)."""
    rng = random.Random(seed)
    T, H, O, S = rng.randint(1, max_t), rng.randint(1, max_h), rng.randint(1, max_h), rng.randint(1, max_s)
    H, O = -(-H // align) * align, -(-O // align) * align
    ranks = [rng.randint(1, max_r) for _ in range(S)]
    R = -(-max(ranks) // align) * align
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=dtype)
    A = torch.randn(S, R, H, generator=g, dtype=dtype) / H**0.5
    B = torch.randn(S, O, R, generator=g, dtype=dtype) / R**0.5
    for s, r in enumerate(ranks):
        A[s, r:] = 0
        B[s, :, r:] = 0
    pattern = PATTERNS[seed % len(PATTERNS)]
    return x, A, B, token_slots_for(pattern, T, S, rng), pattern


def tolerance(dtype):
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]


def nan_filled(alloc):
    """Wrap an allocator so that fresh float buffers hold NaN: every element must be written."""
    def poisoned(*args, **kwargs):
        t = alloc(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return poisoned


def check_backend(ops, seed, dtype, device="cpu", static=False, **shape):
    x, A, B, token_slots, pattern = make_case(seed, dtype, **shape)
    x, A, B, token_slots = x.to(device), A.to(device), B.to(device), token_slots.to(device)
    meta = make_meta(token_slots, A.shape[0], static=static)
    base = torch.randn(x.shape[0], B.shape[1], dtype=dtype, device=device)
    out = base.clone()
    scale = 0.5 + seed % 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", nan_filled(torch.empty))
        mp.setattr(torch.Tensor, "new_empty", nan_filled(torch.Tensor.new_empty))
        y = ops.lora_shrink(x, A, meta, scale=scale)
        ops.lora_expand(out, y, B, meta)
    expected = base + lora_reference(x, A, B, token_slots, scale)
    tol = tolerance(dtype)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol, msg=lambda m: f"{pattern}: {m}")
    none = token_slots < 0
    assert torch.equal(out[none], base[none]), "rows without LoRA must be left untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(42))
def test_torch_path(seed, dtype):
    check_backend(torch_lora, seed, dtype)


def test_torch_path_refuses_static_metadata():
    # Static metadata is for the Triton kernels; compiled CPU passes take the bank's packed path.
    meta = make_meta(torch.tensor([0, -1]), 2, static=True)
    with pytest.raises(ValueError, match="static metadata"):
        torch_lora.lora_shrink(torch.ones(2, 4), torch.ones(2, 3, 4), meta)


def test_static_metadata_has_fixed_shapes():
    a = make_meta(torch.tensor([2, -1, 0, 2]), 5, static=True)
    b = make_meta(torch.tensor([-1, -1, -1, -1]), 5, static=True)
    for name in ("token_slots", "sorted_tokens", "slot_counts", "slot_starts", "offsets"):
        assert getattr(a, name).shape == getattr(b, name).shape
    assert a.offsets.tolist() == [1, 1, 3, 3, 3] and b.offsets.tolist() == [0] * 5
    assert not b.no_lora  # static passes always run the ops


@pytest.mark.parametrize("seed", range(14))
def test_torch_path_aligned(seed):
    # Aligned strides take torch._grouped_mm (where this torch has it) instead of the loop.
    check_backend(torch_lora, seed, torch.float32, align=8)


@pytest.mark.parametrize("seed", range(7))
def test_torch_path_bf16(seed):
    check_backend(torch_lora, seed, torch.bfloat16, max_r=16, align=8)


def test_torch_path_large_hidden():
    check_backend(torch_lora, 3, torch.float32, max_t=64, max_h=2048, max_r=64)


def _triton_device():
    """Where the Triton tests run: CUDA, or the CPU under TRITON_INTERPRET=1; else None."""
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def _triton_ops():
    if _triton_device() is None:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (test_triton_interpreter runs it in a subprocess)")
    return pytest.importorskip("hf_invisiblelora.kernels.triton_lora")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(14))  # each popularity pattern twice
def test_triton_kernels(seed, dtype):
    if dtype == torch.bfloat16 and _triton_device() == "cpu":
        pytest.skip("Triton's interpreter mishandles bf16 loads/stores")
    # Small shapes under the interpreter (it runs every program in Python); still several tiles.
    check_backend(_triton_ops(), seed, dtype, _triton_device(), max_t=40, max_h=150, max_r=40, max_s=8)


@pytest.mark.parametrize("seed", range(7))
def test_triton_kernels_static_metadata(seed):
    check_backend(_triton_ops(), seed, torch.float32, _triton_device(), static=True, max_t=40, max_h=150, max_r=40, max_s=8)


@pytest.mark.parametrize("seed", range(3))
def test_triton_kernels_ranks_to_256(seed):
    check_backend(_triton_ops(), seed, torch.float32, _triton_device(), max_t=20, max_h=80, max_r=256, max_s=4)


def check_group_slice(ops, dtype, device, transposed):
    """q/k/v siblings share one shrink: a layer's A is a column slice of the group's stack (a
    strided view). Both ops take it as given."""
    g = torch.Generator().manual_seed(5)
    S, H, O, ranks = 4, 48, 40, (8, 4, 12)
    stacks = [torch.randn(S, r, H, generator=g, dtype=dtype) / H**0.5 for r in ranks]
    group = torch.cat(stacks, 1)
    if transposed:  # the torch path's layout: [S, H, R] storage seen as [S, R, H]
        group = group.transpose(1, 2).contiguous().transpose(1, 2)
    group = group.to(device)
    A = group[:, ranks[0] : ranks[0] + ranks[1]]  # the middle sibling
    B = (torch.randn(S, O, ranks[1], generator=g, dtype=dtype) / 2).to(device)
    x = torch.randn(10, H, generator=g, dtype=dtype).to(device)
    token_slots = torch.tensor([0, 3, -1, 1, 1, 2, 0, -1, 3, 2], device=device)
    out = torch.zeros(10, O, dtype=dtype, device=device)
    meta = make_meta(token_slots, S)
    ops.lora_expand(out, ops.lora_shrink(x, A, meta), B, meta)
    tol = tolerance(dtype)
    torch.testing.assert_close(out, lora_reference(x, A, B, token_slots), rtol=tol, atol=tol)


@pytest.mark.parametrize("transposed", [False, True])
def test_torch_path_group_slice(transposed):
    check_group_slice(torch_lora, torch.float64, "cpu", transposed)


@pytest.mark.parametrize("transposed", [False, True])
def test_triton_group_slice(transposed):
    check_group_slice(_triton_ops(), torch.float32, _triton_device(), transposed)


@pytest.mark.parametrize("round_delta", [True, False])
def test_torch_path_peft_numerics_on_bf16(round_delta):
    """float32 adapters on a bfloat16 model, as PEFT keeps them: the input is cast to float32, the
    delta computed in float32 and added as PEFT adds it (rounded first for a mixed batch, else in
    float32 then rounded): bit-equal to PEFT's formula here."""
    g = torch.Generator().manual_seed(0)
    S, H, O, R = 3, 32, 24, 8
    A, B = torch.randn(S, R, H, generator=g), torch.randn(S, O, R, generator=g)
    x = torch.randn(6, H, generator=g).bfloat16()
    base = torch.randn(6, O, generator=g).bfloat16()
    token_slots = torch.tensor([0, 2, 1, -1, 2, 0])
    meta = make_meta(token_slots, S)
    out = base.clone()
    torch_lora.lora_expand(out, torch_lora.lora_shrink(x.float(), A, meta), B, meta, round_delta=round_delta)
    expected = base.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            delta = (x[t].float() @ A[s].T) @ B[s].T
            expected[t] = expected[t] + delta.bfloat16() if round_delta else (expected[t].float() + delta).bfloat16()
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=2 ** -6)
    assert (out != expected).float().mean() < 0.05  # rounding-order ties only


def test_triton_refuses_dtypes_it_was_not_written_for():
    ops = pytest.importorskip("hf_invisiblelora.kernels.triton_lora")
    meta = make_meta(torch.tensor([0, 1]), 2)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        ops.lora_shrink(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, 4, dtype=torch.float64), meta)
    with pytest.raises(TypeError, match="cast x to A's dtype"):
        ops.lora_shrink(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(2, 4, 4), meta)
    with pytest.raises(TypeError, match="float32 output"):
        ops.lora_expand(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float16), torch.zeros(2, 4, 4), meta)


@pytest.mark.slow
def test_triton_interpreter():
    """Runs test_triton_kernels on the CPU: TRITON_INTERPRET must be set before triton is imported."""
    pytest.importorskip("triton")
    if _triton_device() is not None:
        pytest.skip("test_triton_kernels runs in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
           "test_triton_kernels or test_triton_group_slice"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"\b40 passed", run.stdout), run.stdout[-1000:]  # fp32, fp16, static, slices ran; bf16 skipped


def test_make_meta():
    token_slots = torch.tensor([2, -1, 0, 2, 0, -1, 3])
    meta = make_meta(token_slots, 5)
    assert meta.sorted_tokens.tolist() == [2, 4, 0, 3, 6, 1, 5]  # stable, no-LoRA tokens last
    assert meta.slot_counts.tolist() == [2, 0, 2, 1, 0]
    assert meta.slot_starts.tolist() == [0, 2, 2, 4, 5]
    assert meta.active.tolist() == [0, 2, 3] and meta.offsets.tolist() == [2, 4, 5]
    assert meta.num_lora_tokens == 5 and not meta.no_lora and meta.lora_range is None
    assert make_meta(torch.tensor([1, 1, 3, -1]), 4).lora_range == (0, 3)
    assert make_meta(torch.full((3,), -1), 4).no_lora


@pytest.mark.parametrize("seed", range(20))
def test_token_runs(seed):
    """Maximal runs of one slot in token order, no-LoRA tokens left out, against a loop over the tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-1, 4, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g)
    token_slots = rows.repeat_interleave(torch.randint(1, 5, rows.shape, generator=g))
    expected, slots = [], token_slots.tolist()
    for t, s in enumerate(slots):
        if expected and expected[-1][0] == s and expected[-1][2] == t:
            expected[-1] = (s, expected[-1][1], t + 1)
        elif s >= 0:
            expected.append((s, t, t + 1))
    assert token_runs(make_meta(token_slots, 4)) == expected


def test_weight_cache_follows_active_set():
    A = torch.randn(4, 8, 16)
    first = make_meta(torch.tensor([0, 2, 2]), 4)
    torch_lora.lora_shrink(torch.randn(3, 16), A, first)
    assert make_meta(torch.tensor([2, 0, -1, 0]), 4, previous=first).cache is first.cache
    assert make_meta(torch.tensor([1, 2]), 4, previous=first).cache is not first.cache


def test_backend_env(monkeypatch):
    monkeypatch.setenv("HF_INVISIBLELORA_BACKEND", "torch")
    assert get_backend(torch.device("cuda")) is torch_lora
    monkeypatch.setenv("HF_INVISIBLELORA_BACKEND", "auto")
    assert get_backend(torch.device("cpu")) is torch_lora
    monkeypatch.setenv("HF_INVISIBLELORA_BACKEND", "fast")
    with pytest.raises(ValueError, match="auto, torch or triton"):
        get_backend(torch.device("cpu"))
