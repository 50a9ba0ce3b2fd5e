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


class _CacheLayer(CacheLayerMixin):
    """One layer's keys and values: [capacity, heads, max_len, head_dim], written where the pass context says."""

    is_compileable = True

    def __init__(self, cache: "SharedCache"):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states, value_states):
        c = self.cache
        h = key_states.shape[1]
        # Plain tensors, also when the first pass runs in inference mode: the cache outlives the pass
        # and is written outside passes too (prefix cache, row resets).
        with torch.inference_mode(False):
            self.keys = key_states.new_zeros(c.capacity, h, c.max_len, key_states.shape[-1])
            self.values = value_states.new_zeros(c.capacity, h, c.max_len, value_states.shape[-1])
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p = self.cache.context
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)  # [b, q, heads, dim]
        if p.real is not None:  # per-row query lengths: only each row's real tokens
            k, v = k[p.real], v[p.real]
        # Indexed assignment (index_put_), not scatter_: torch.compile updates the cache in place
        # with it, where scatter_ into a graph input copies the whole cache twice per layer.
        self.keys[p.write_rows, :, p.write_slots] = k
        self.values[p.write_rows, :, p.write_slots] = v
        if p.rows is not None:  # a pass over some rows only (a slice: a view; indices: a copy)
            return self.keys[p.rows, :, : p.kv_len], self.values[p.rows, :, : p.kv_len]
        return self.keys[:, :, : p.kv_len], self.values[:, :, : p.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.context.kv_len, 0

    def get_seq_length(self) -> int:
        return self.cache.context.kv_len

    def get_max_length(self) -> int:
        return self.cache.max_len


class SharedCache(Cache):
    """Preallocated KV cache with per-row write positions (see the module docstring): ``capacity``
    rows of ``max_len`` slots, written and read as the decoder's pass context (context.py) says.
    A pass that would write past them raises instead of dropping entries."""

    def __init__(self, config, capacity: int, max_len: int, context):
        text_config = config.get_text_config(decoder=True)
        super().__init__(layers=[_CacheLayer(self) for _ in range(text_config.num_hidden_layers)])
        self.capacity, self.max_len, self.context = capacity, max_len, context

    def check_room(self, kv_len: int) -> None:
        if kv_len > self.max_len:
            raise RuntimeError(f"SharedCache overflow: {kv_len} slots needed, {self.max_len} allocated")

    @property
    def nbytes(self) -> int:
        return sum(x.keys.nbytes + x.values.nbytes for x in self.layers if x.is_initialized)

    def clear(self, rows: list[int], start: int = 0) -> None:
        """Zero the slots of ``rows`` from ``start`` on (rows given to new requests; the slots before
        ``start`` hold a continued cache, SharedCache.load). A pass reads a row's slots up to
        ``kv_len`` whatever its mask hides, and masking adds to a score: a NaN or Inf key or value a
        row's last request left (an adapter whose activations overflowed in its own rows) would
        reach the next request's outputs (NaN + finfo.min is NaN, NaN x 0 is NaN)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[rows, :, start:] = 0
                layer.values[rows, :, start:] = 0

    def load(self, cache: DynamicCache, rows: int) -> None:
        """Slots [0, n) of rows 0..rows-1 from ``cache``, a DynamicCache of ``rows`` rows holding n
        tokens each (the cache a continued generate() call is passed: the keys and values of its
        tokens at their slots, as standard decoding's own cache holds them)."""
        for layer, given in zip(self.layers, cache.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(given.keys, given.values)
            n = given.keys.shape[-2]
            layer.keys[:rows, :, :n] = given.keys
            layer.values[:rows, :, :n] = given.values

    def read(self, row: int, start: int, n: int) -> tuple:
        """Copies of slots [start, start + n) of ``row``: per layer that holds entries (keys, values)
        [heads, n, head_dim] (a prompt block a prefix cache keeps, engine/prefix_cache.py)."""
        return tuple((layer.keys[row, :, start : start + n].clone(), layer.values[row, :, start : start + n].clone())
                     for layer in self.layers if layer.is_initialized)

    def write(self, row: int, start: int, blocks: list) -> None:
        """Slots of ``row`` from ``start`` on, block after block, from ``blocks`` (each what ``read``
        gave)."""
        for block in blocks:
            n = block[0][0].shape[1]
            for layer, (k, v) in zip([x for x in self.layers if x.is_initialized], block, strict=True):
                layer.keys[row, :, start : start + n] = k
                layer.values[row, :, start : start + n] = v
            start += n

    def to_dynamic(self, config, length: int, rows: int, copy: bool, into: DynamicCache | None = None) -> DynamicCache:
        """The first ``length`` slots of the first ``rows`` rows as the DynamicCache standard
        generate() returns (views of this cache unless ``copy``: a kept cache is reused later).
        ``into``: the DynamicCache generate() was passed, holding the first n slots already, extended
        in place with the others and returned, as standard decoding extends it."""
        out = DynamicCache(config=config) if into is None else into
        start = out.get_seq_length()
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                k, v = layer.keys[:rows, :, start:length], layer.values[:rows, :, start:length]
                out.update(k.clone() if copy else k, v.clone() if copy else v, i)
        return out

