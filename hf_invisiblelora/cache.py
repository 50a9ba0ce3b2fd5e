"""The hybrid KV cache: one preallocated cache shared by the drafter (LoRA off) and the verifier (LoRA on).

Layout: cache slot ``j`` of row ``b`` holds the key/value of token ``j`` of that row's token buffer
(left padding included), so a row's valid slots are always the contiguous range ``[pad[b], end)``.
Every forward writes its ``q`` tokens per row at per-row slots ``start[b] .. start[b] + q - 1``:

- a draft step writes speculative (LoRA-off) entries after the committed prefix;
- the verify pass writes at the same slots again, overwriting them with LoRA-on entries;
- a rejected draft needs no rollback: its slot lies past the row's new end and the next
  forward overwrites it. Nothing is copied, and rows stay compact whatever they accept.

The attention mask is rebuilt per forward from (pad, start, q): query ``t`` of row ``b`` sees
slots ``pad[b] <= j <= start[b] + t`` (and, for sliding-window layers, ``j > start[b] + t - window``).
Only the first ``kv_len = max(start) + q`` slots take part in attention.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Layer(CacheLayerMixin):
    is_compileable = True

    def __init__(self, owner: "HybridCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states):
        o = self.owner
        b, h = key_states.shape[:2]
        self.keys = key_states.new_zeros(b, h, o.max_len, key_states.shape[-1])
        self.values = value_states.new_zeros(b, h, o.max_len, value_states.shape[-1])
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        # Indexed assignment (index_put_), not scatter_: torch.compile updates the cache in place
        # with it, where scatter_ into a graph input copies the whole cache twice per layer.
        self.keys[o.write_rows, :, o.write_slots] = key_states.transpose(1, 2)
        self.values[o.write_rows, :, o.write_slots] = value_states.transpose(1, 2)
        return self.keys[:, :, : o.kv_len], self.values[:, :, : o.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_max_length(self) -> int:
        return self.owner.max_len


class HybridCache(Cache):
    """Preallocated KV cache with per-row write positions (see the module docstring).

    ``pad``: [B] left-padding length per row. ``max_len``: slots per row; a forward that would
    write past it raises instead of silently dropping entries.
    """

    def __init__(self, config, pad: torch.Tensor, max_len: int):
        text_config = config.get_text_config(decoder=True)
        super().__init__(layers=[_Layer(self) for _ in range(text_config.num_hidden_layers)])
        self.pad = pad
        self.max_len = max_len
        layer_types = getattr(text_config, "layer_types", None) or []
        self.window = getattr(text_config, "sliding_window", None) if "sliding_attention" in layer_types else None
        self.kv_len = 0
        self.write_rows = self.write_slots = None  # [B, 1], [B, q]: where the next forward writes

    def prepare(self, start: torch.Tensor, q: int, kv_len: int, dtype: torch.dtype):
        """Set up the next forward: row b writes ``q`` slots from ``start[b]``; returns (mask, position_ids).

        ``kv_len`` must be ``max(start) + q`` (given by the caller, who knows it without a device sync).
        The mask is additive (0 / dtype min), [B, 1, q, kv_len]; for models with sliding-window layers,
        a dict by layer type, as Transformers' models accept.
        """
        if kv_len > self.max_len:
            raise RuntimeError(f"HybridCache overflow: {kv_len} slots needed, {self.max_len} allocated")
        device = start.device
        slots = start[:, None] + torch.arange(q, device=device)  # [B, q] query slots
        self.write_rows, self.write_slots = torch.arange(start.shape[0], device=device)[:, None], slots
        self.kv_len = kv_len
        j = torch.arange(kv_len, device=device)[None, None, :]  # key slots
        visible = (j >= self.pad[:, None, None]) & (j <= slots[:, :, None])  # [B, q, kv]
        position_ids = (slots - self.pad[:, None]).clamp(min=0)
        mask = _additive(visible, dtype)
        if self.window is not None:
            in_window = visible & (j > slots[:, :, None] - self.window)
            mask = {"full_attention": mask, "sliding_attention": _additive(in_window, dtype)}
        return mask, position_ids


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Eager attention ADDS the mask, so a boolean mask would be silently wrong there.
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)[:, None]


def model_pass(model, cache: HybridCache, ids, start, kv_len: int, keep: int):
    """One model pass over ``ids`` [B, q] written at per-row cache slots ``start`` [B]; logits of the last ``keep``."""
    mask, position_ids = cache.prepare(start, ids.shape[1], kv_len, model.dtype)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=keep
    )
    return out.logits
