"""What the batched multi-LoRA kernels share: the per-forward metadata and the choice of backend.

The folder ``kernels/`` installs as ``hf_invisiblelora.kernels``, a package without ``__init__.py``: the
top-level import name ``kernels`` is Hugging Face's package (Transformers imports it), and a folder without
``__init__.py`` on ``sys.path`` cannot shadow it.

A batch mixes adapters token by token. Per forward we compute one ``LoraMeta`` (which token uses
which adapter slot, the tokens sorted by slot, per-slot counts and offsets) and every LoRA layer
reuses it for two ops, Punica/vLLM style:

    y   = lora_shrink(x, A, meta)      # y[i]   = scale * x[tok_i] @ A[slot(tok_i)].T
    lora_expand(out, y, B, meta)       # out[tok_i] += y[i] @ B[slot(tok_i)].T

where tok_i = meta.sorted_tokens[i] runs over the tokens that use an adapter (i < num_lora_tokens).
Static metadata (``make_meta(..., static=True)``) has shapes fixed by T and S alone and no host
values, so a compiled graph or a CUDA graph can read it from buffers updated in place.
Two backends implement them with identical semantics: Triton (CUDA; CPU only under
TRITON_INTERPRET=1) and torch (everywhere). ``get_backend`` picks one; the environment variable
HF_INVISIBLELORA_BACKEND=auto|torch|triton forces it.
"""

import os
from dataclasses import dataclass, field

import torch

from . import torch_lora

BACKEND_ENV = "HF_INVISIBLELORA_BACKEND"


@dataclass
class LoraMeta:
    """Per-forward metadata shared by every LoRA layer (T tokens, S adapter slots)."""

    token_slots: torch.Tensor  # [T] long: slot per token, -1 = no LoRA
    sorted_tokens: torch.Tensor  # [T] long: tokens stably sorted by slot, no-LoRA tokens last
    slot_counts: torch.Tensor  # [S] int32: tokens per slot
    slot_starts: torch.Tensor  # [S] int32: index in sorted_tokens of each slot's first token
    active: torch.Tensor | None  # [n_active] long: slots with at least one token, ascending (None: static)
    offsets: torch.Tensor  # [n_active] int32: cumulative token counts of the active slots ([S]: static)
    bounds: list | None  # host copy of offsets (None: static, whose ops read them when they run)
    num_lora_tokens: int
    # (start, stop) when the LoRA tokens, sorted, are exactly tokens start..stop-1: then the torch
    # path slices x and out instead of gathering and scattering rows.
    lora_range: tuple | None
    # The torch path's padded layout: the LoRA tokens of active slot g at rows g*width .. of a
    # [G * width] index (padding: token 0, masked out), so one batched matmul serves every slot.
    pad_index: torch.Tensor | None = None  # [G * width] long
    pad_mask: torch.Tensor | None = None  # [G, width, 1] bool: True for a real token, False for padding
    pad_positions: torch.Tensor | None = None  # [n] long: where sorted LoRA token i sits in the padded layout
    # Prepared weight copies for this set of active slots, filled lazily by the torch path and
    # carried over to the next forward's metadata while the active set stays the same.
    cache: dict = field(default_factory=dict)
    # Per-forward values derived from token_slots (e.g. the packed path's column masks): never carried over.
    masks: dict = field(default_factory=dict)
    active_slots: tuple | None = None  # host copy of active
    path: str | None = None  # the torch path this forward takes, once chosen (the bank's: lora/layer.py)
    runs: list | None = None  # host list of the LoRA tokens' runs, once read (token_runs)
    static: bool = False  # shapes fixed: all slots and all tokens take part; see make_meta

    @property
    def no_lora(self) -> bool:
        return self.num_lora_tokens == 0


def make_meta(token_slots: torch.Tensor, num_slots: int, previous: LoraMeta | None = None,
              static: bool = False) -> LoraMeta:
    """Semantics:
        key[t] = token_slots[t] if token_slots[t] >= 0 else S        # no-LoRA tokens sort last
        sorted_tokens = stable_argsort(key)
        slot_counts[s] = #{t : token_slots[t] == s};  slot_starts = exclusive_cumsum(slot_counts)
        active = [s for s in range(S) if slot_counts[s] > 0];  offsets = cumsum(slot_counts[active])
        static: active = None (all slots), offsets = cumsum(slot_counts) [S], num_lora_tokens = T
                (the torch path gives the no-LoRA tokens, sorted last, a zero delta)
        padded layout (torch path; when padding at most doubles the rows): active slot g's tokens
                at pad_index[g * width + i], i < its count; the rest 0 with pad_mask False
    token_slots: [T] long in [-1, S). `previous`: the last forward's metadata; its weight cache is
    reused when the active slots are the same.
    """
    token_slots = token_slots.long()
    key = torch.where(token_slots < 0, num_slots, token_slots)
    sorted_tokens = torch.sort(key, stable=True).indices
    slot_counts = torch.bincount(key, minlength=num_slots + 1)[:num_slots]
    common = dict(token_slots=token_slots, sorted_tokens=sorted_tokens, slot_counts=slot_counts.int(),
                  slot_starts=(slot_counts.cumsum(0) - slot_counts).int())
    if static:
        return LoraMeta(**common, active=None, offsets=slot_counts.cumsum(0).int(),
                        bounds=None, num_lora_tokens=token_slots.shape[0], lora_range=None, static=True)
    active = slot_counts.nonzero().squeeze(1)
    offsets = slot_counts[active].cumsum(0)
    bounds = offsets.tolist()  # for the torch path: its ops need no host read of their own
    active_slots = tuple(active.tolist())
    n = bounds[-1] if bounds else 0
    lora = sorted_tokens[:n]
    start = int(lora[0]) if n else 0
    is_range = n and bool((lora == torch.arange(start, start + n, device=lora.device)).all())
    meta = LoraMeta(**common, active=active, offsets=offsets.int(), bounds=bounds, num_lora_tokens=n,
                    lora_range=(start, start + n) if is_range else None, active_slots=active_slots)
    if n:
        counts = slot_counts[active]
        width = int(counts.max())
        if len(bounds) * width <= 2 * n:  # padding costs at most as much as the tokens themselves
            groups = torch.arange(len(bounds), device=lora.device).repeat_interleave(counts)
            firsts = (offsets - counts).repeat_interleave(counts)
            meta.pad_positions = torch.arange(n, device=lora.device) - firsts + groups * width
            meta.pad_index = torch.zeros(len(bounds) * width, dtype=torch.long, device=lora.device)
            meta.pad_index[meta.pad_positions] = lora
            meta.pad_mask = torch.zeros(len(bounds) * width, dtype=torch.bool, device=lora.device)
            meta.pad_mask[meta.pad_positions] = True
            meta.pad_mask = meta.pad_mask.view(len(bounds), width, 1)
    if previous is not None and previous.active_slots == active_slots:
        meta.cache = previous.cache
    return meta


def token_runs(meta: LoraMeta) -> list:
    """Semantics:
        [(s, lo, hi) for each maximal run token_slots[lo:hi] == s of one slot s >= 0, in token order]
    A prefill's rows are runs of consecutive tokens (fewer where neighbouring rows share an adapter).
    Read to the host once per metadata (two small reads) and kept on it."""
    if meta.runs is None and not meta.token_slots.shape[0]:
        meta.runs = []
    if meta.runs is None:
        slots = meta.token_slots
        starts = torch.cat([slots.new_zeros(1), (slots[1:] != slots[:-1]).nonzero().squeeze(1) + 1])
        bounds = starts.tolist() + [slots.shape[0]]
        meta.runs = [(s, lo, hi) for s, lo, hi in zip(slots[starts].tolist(), bounds, bounds[1:]) if s >= 0]
    return meta.runs


def get_backend(device: torch.device, dtype: torch.dtype = torch.float32):
    """The module (torch_lora or triton_lora) whose lora_shrink/lora_expand serve `device`.
    auto: Triton on CUDA for fp32/fp16/bf16 (its intermediate is fp32), torch otherwise."""
    choice = os.environ.get(BACKEND_ENV, "auto")
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected auto, torch or triton")
    triton_fits = torch.device(device).type == "cuda" and dtype in (torch.float32, torch.float16, torch.bfloat16)
    if choice == "torch" or (choice == "auto" and not triton_fits):
        return torch_lora
    if choice == "triton":
        from . import triton_lora  # an ImportError here is the answer to a forced backend

        return triton_lora
    try:
        from . import triton_lora
    except ImportError:
        return torch_lora
    return triton_lora
