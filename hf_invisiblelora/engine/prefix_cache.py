"""Automatic prefix caching: the keys and values of prompt blocks, kept after a request's prefill and
found again for a later request whose prompt starts with the same tokens under the same weights,
which then prefills only the rest (vLLM's automatic prefix caching, SGLang's radix cache).

    prefixes = PrefixCaching(model, max_bytes, check)    # the serving engine's (engine.py)
    hits, rest = prefixes.lookup(joining)                 # [((row, handle), blocks)], the others
    prefixes.admitted(row)                                # a request's prefill starts
    prefixes.keep(kv, row, adapter, tokens, start)        # its prompt, later with its output: keep blocks
    prefixes.released(row)                                # its row is free
    prefixes.renew(check)                                 # the model may have changed (adapters)

    cache = PrefixCache(max_bytes)                        # the blocks themselves
    keys = cache.chain(root, prompt)                      # one key per full block of BLOCK tokens
    n = cache.match(keys)                                 # how many blocks from the start are kept
    cache.read(keys[:n]) / cache.store(keys, block)

A block's key is a hash chain: block i's key hashes block i - 1's key and block i's tokens, block
0's hashes the ``root``. The root is the revision of everything else the keys and values depend on
(``Revisions``): the base model's tensors (its weights, and buffers such as the rotary embedding's
frequencies), and the adapter's own tensors and settings (its LoRA weights, DoRA magnitudes,
modules_to_save copies, embedding LoRA, scaling, rank), by their contents, never by name. So an
adapter reloaded with new weights, another one under the same name, an adapter whose scale was
set, edited base weights, another dtype: each is another root, and no block of one is ever read
for another. ``__base__`` rows have the base model's root alone.

Keys and values of a token depend on its position, which a block's place in the chain fixes
(positions follow a row's own tokens, whatever padding its group had). What the chain cannot
key, the engine does not cache: windowed cache layers and rotary embeddings that change with the
sequence length (engine.py turns prefix caching off for such models and says so at start).

Bounded in bytes, least recently used first. A lookup touches its blocks from the last to the
first, and a store does the same, so a chain's first blocks are always at least as recent as its
later ones and eviction takes chains from their ends (a block without its predecessors could never
be matched).
"""

from __future__ import annotations

import array
import collections
import operator

import torch
import xxhash
from torch import nn

from ..model.derived import SourceCheck
from ..model.walk import BASE

BLOCK = 16  # tokens per block (vLLM's default block size)


class PrefixCaching:
    """The serving engine's prefix caching: a PrefixCache of ``max_bytes`` and the roots of the model's
    current weights (``Revisions``). A request's blocks are kept when its prompt is in the cache, and
    again when it ends, with its output (all of it but its last token, whose keys and values no pass
    has computed yet: a chat's next turn repeats both), as vLLM keeps a request's full blocks. They
    are kept only if no adapter changed since its admission (``renew`` in between: a change cut
    through its passes, so its keys and values may be half old). Requests that want their prompt's
    log-probabilities prefill it whole (every position's logits) and are not looked up.
    ``queries`` / ``hits``: prompt tokens looked up / found (vLLM's prefix cache counters)."""

    def __init__(self, model, max_bytes: int, check: SourceCheck | None = None):
        self.model, self.cache = model, PrefixCache(max_bytes)
        self.revisions = Revisions(model, check)
        self.epoch = 0  # renewals so far
        self._admitted = {}  # row -> the epoch its request was admitted in
        self.queries = self.hits = 0

    def renew(self, check: SourceCheck) -> None:
        """After the model's adapters changed (its weights are read again, as the engine's derived
        copies are: session.py)."""
        self.revisions, self.epoch = Revisions(self.model, check), self.epoch + 1

    def lookup(self, joining: list) -> tuple[list, list]:
        """([((row, handle), blocks)] for the joining (row, handle) pairs whose prompt starts with kept
        blocks (all of it but its last token at most: that one is prefilled for the first token),
        [the others])."""
        hits, rest = [], []
        for row, h in joining:
            prompt = h.request.prompt
            if h.request.prompt_logprobs is not None:
                rest.append((row, h))
                continue
            keys = self.cache.chain(self.revisions.root(h.ref.key), prompt[:-1])
            n = self.cache.match(keys)
            self.queries, self.hits = self.queries + len(prompt), self.hits + n * self.cache.block
            if n:
                hits.append(((row, h), self.cache.read(keys[:n])))
            else:
                rest.append((row, h))
        return hits, rest

    def admitted(self, row: int) -> None:
        self._admitted[row] = self.epoch

    def released(self, row: int) -> None:
        self._admitted.pop(row, None)

    def keep(self, kv, row: int, adapter: str, tokens: list[int], start: int) -> None:
        """The keys and values of ``tokens`` (row ``row``'s request under ``adapter``, its revision's key:
        adapters.AdapterRef) are in ``kv`` (the engine's SharedCache) from slot ``start`` on: keep their
        full blocks, unless a renewal came since the request's admission."""
        if self._admitted.get(row) != self.epoch:
            return
        block = self.cache.block
        keys = self.cache.chain(self.revisions.root(adapter), tokens)
        self.cache.store(keys, lambda i: kv.read(row, start + i * block, block))


class PrefixCache:
    """Blocks of keys and values (one tuple of per-layer (keys, values) [heads, BLOCK, head_dim]
    each), keyed by ``chain``, at most ``max_bytes`` of them (least recently used first)."""

    def __init__(self, max_bytes: int, block: int = BLOCK):
        self.max_bytes, self.block = max_bytes, block
        self._blocks = collections.OrderedDict()  # key -> (blocks, bytes)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def chain(self, root: bytes, tokens: list[int]) -> list[bytes]:
        """One key per full block of ``tokens``: block i's hashes block i - 1's (block 0: ``root``) and
        its own tokens."""
        keys, key = [], root
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = xxhash.xxh3_128(key)
            h.update(array.array("q", tokens[start : start + self.block]).tobytes())
            key = h.digest()
            keys.append(key)
        return keys

    def match(self, keys: list[bytes]) -> int:
        """How many of ``keys`` are kept from the first on; those blocks become the most recently used."""
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        for key in reversed(keys[:n]):
            self._blocks.move_to_end(key)
        return n

    def read(self, keys: list[bytes]) -> list:
        """The blocks of ``keys`` (all kept: ``match`` said so)."""
        return [self._blocks[key][0] for key in keys]

    def store(self, keys: list[bytes], block) -> None:
        """Keep the blocks of ``keys`` not kept yet, ``block(i)`` giving block i's tensors (copies),
        then evict the least recently used beyond ``max_bytes``. ``bytes`` changes once, to a total
        within the bound: the engine's counters read it from other threads."""
        total = self.bytes
        for i, key in enumerate(keys):
            if key not in self._blocks:
                tensors = block(i)
                size = sum(k.nbytes + v.nbytes for k, v in tensors)
                if size > self.max_bytes:
                    break
                self._blocks[key] = (tensors, size)
                total += size
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)
        while total > self.max_bytes:
            _, (_, size) = self._blocks.popitem(last=False)
            total -= size
        self.bytes = total

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0


def _value(v):
    """What a setting of an adapter contributes to its revision: a module by its type and tensors."""
    if isinstance(v, nn.Module):
        return (type(v).__qualname__, *v.state_dict(keep_vars=True).values())
    return v


class Revisions:
    """The roots of ``PrefixCache.chain``: per adapter (or ``__base__``), a digest of the base model's
    tensors and the adapter's own (derived.py's digests, through ``check``: tensors already digested
    for the engine's derived copies are not read again). Made again whenever the model may have
    changed (the engine's adapter changes, as its derived copies are)."""

    def __init__(self, model, check: SourceCheck | None = None):
        self.model, self.check = model, check or SourceCheck()
        self._roots = {}
        self._base = None

    def root(self, adapter: str) -> bytes:
        if adapter not in self._roots:
            if self._base is None:
                self._base = self._digest(self._base_tensors())
            own = () if adapter == BASE else self._digest(adapter_state(self.model, adapter))
            self._roots[adapter] = xxhash.xxh3_128(repr((self._base, own)).encode()).digest()
        return self._roots[adapter]

    def _digest(self, items: list) -> tuple:
        return tuple((name, self.check((v,))[0]) for name, v in items)

    def _base_tensors(self) -> list:
        """Every parameter and buffer of the model that belongs to no adapter, by name."""
        owned = {id(v) for name in self.model.peft_config for _, v in adapter_state(self.model, name)
                 if isinstance(v, torch.Tensor)}
        named = list(self.model.named_parameters()) + list(self.model.named_buffers())
        return [(n, t) for n, t in named if id(t) not in owned]


def adapter_state(model, name: str) -> list:
    """(place, value) of everything of adapter ``name`` in the model's PEFT layers: the tensors of
    their per-adapter containers (PEFT's ``adapter_layer_names``: lora_A / lora_B, the embedding
    LoRA, DoRA's magnitudes, modules_to_save's copies) and their per-adapter settings
    (``other_param_names``: rank, alpha, scaling, use_dora, ...)."""
    out = []
    for path, m in model.named_modules():
        for attr in getattr(m, "adapter_layer_names", ()):
            container = _get(m, attr)
            if container is not None and name in container:
                entry = container[name]
                tensors = entry.state_dict(keep_vars=True).items() if isinstance(entry, nn.Module) else [("", entry)]
                out += [(f"{path}.{attr}.{k}", t) for k, t in tensors]
        for attr in getattr(m, "other_param_names", ()):
            settings = _get(m, attr)
            if isinstance(settings, (dict, nn.ModuleDict)) and name in settings:
                out.append((f"{path}.{attr}", _value(settings[name])))
    return out


def _get(m, attr: str):
    try:
        return operator.attrgetter(attr)(m)
    except AttributeError:
        return None
