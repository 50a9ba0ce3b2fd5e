"""The shared KV cache: one preallocated cache for the drafter (LoRA off) and the verifier (LoRA on).

Cache slot ``j`` of row ``b`` holds the key/value of token ``j`` of that row (layout.py), so a
row's committed entries always sit at the same slots as in standard decoding. Every forward
writes its ``q`` tokens per row at per-row slots ``start[b] .. start[b] + q - 1``:

- a draft step writes speculative (LoRA-off) entries after the committed prefix;
- the verify pass writes at the same slots again, overwriting them with LoRA-on entries;
- a rejected draft needs no rollback: its slot lies past the row's new end and the next
  forward overwrites it. Nothing is copied, and rows stay compact whatever they accept.

Only the first ``kv_len`` slots take part in attention; the masks (layout.py) say which.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

# Cache layer kinds (Transformers' names) whose entries are plain per-token keys and values.
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


class _Layer(CacheLayerMixin):
    is_compileable = True

    def __init__(self, owner: "SharedCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states):
        o = self.owner
        h = key_states.shape[1]
        self.keys = key_states.new_zeros(o.capacity, h, o.max_len, key_states.shape[-1])
        self.values = value_states.new_zeros(o.capacity, h, o.max_len, value_states.shape[-1])
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
        if o.rows is not None:  # a pass over some rows only (a slice: a view; indices: a copy)
            return self.keys[o.rows, :, : o.kv_len], self.values[o.rows, :, : o.kv_len]
        return self.keys[:, :, : o.kv_len], self.values[:, :, : o.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.kv_len

    def get_max_length(self) -> int:
        return self.owner.max_len


class SharedCache(Cache):
    """Preallocated KV cache with per-row write positions (see the module docstring): ``capacity``
    rows of ``max_len`` slots. A forward that would write past them raises instead of dropping entries."""

    def __init__(self, config, capacity: int, max_len: int):
        text_config = config.get_text_config(decoder=True)
        super().__init__(layers=[_Layer(self) for _ in range(text_config.num_hidden_layers)])
        self.capacity, self.max_len = capacity, max_len
        self.kv_len = 0
        self.rows = None  # the rows of the next forward, if not all
        self.write_rows = self.write_slots = None  # [b, 1], [b, q]: where the next forward writes

    def prepare(self, start: torch.Tensor, q: int, kv_len: int, rows=None) -> None:
        """The next forward writes ``q`` slots per row from ``start[b]`` and attends to ``kv_len`` slots
        (``max(start) + q``, given by the caller, who knows it without a device sync). ``rows``: the
        rows it runs, if not all (``start`` is theirs)."""
        if kv_len > self.max_len:
            raise RuntimeError(f"SharedCache overflow: {kv_len} slots needed, {self.max_len} allocated")
        self.rows = rows
        if rows is None or isinstance(rows, slice):  # the first rows (a view of the cache, no copy)
            self.rows = None if rows is None or rows == slice(0, self.capacity) else rows
            rows = torch.arange(start.shape[0], device=start.device)
        self.write_rows = rows[:, None]
        self.write_slots = start[:, None] + torch.arange(q, device=start.device)
        self.kv_len = kv_len

    @property
    def nbytes(self) -> int:
        return sum(x.keys.nbytes + x.values.nbytes for x in self.layers if x.is_initialized)

    def to_dynamic(self, config, length: int, rows: int, copy: bool) -> DynamicCache:
        """The first ``length`` slots of the first ``rows`` rows as the DynamicCache standard
        generate() returns (views of this cache unless ``copy``: a kept cache is reused later)."""
        out = DynamicCache(config=config)
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                k, v = layer.keys[:rows, :, :length], layer.values[:rows, :, :length]
                out.update(k.clone() if copy else k, v.clone() if copy else v, i)
        return out


def model_pass(model, cache: SharedCache, masks, position_ids, ids, start, kv_len: int, keep: int, rows=None):
    """One model pass over ``ids`` [b, q] written at per-row cache slots ``start`` [b] (of ``rows``,
    default all); logits of the last ``keep``."""
    cache.prepare(start, ids.shape[1], kv_len, rows)
    out = model(input_ids=ids, attention_mask=masks, position_ids=position_ids, cache=cache, use_cache=True,
                logits_to_keep=keep)
    cache.rows = None
    return out.logits
