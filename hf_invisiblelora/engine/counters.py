"""What the serving engine counts as it runs, and the adapters it serves, as other threads read them
(the server's /metrics and /v1/models, a router's affinity): written on the engine's thread, read
under one lock."""

from __future__ import annotations

import collections
import threading


class Counters:
    """``values`` (the engine's ``metrics``): cycles, tokens, requests, failed cycles and requests,
    the k of each cycle, drafted / accepted drafts per adapter, adapters loaded; ``adapters``: {name
    served: its folder}."""

    def __init__(self, pool, model):
        self.lock = threading.Lock()
        self.pool, self.model = pool, model
        self.values = dict(cycles=0, tokens=0, k_hist=collections.Counter(), drafted=collections.Counter(),
                           accepted=collections.Counter(), requests=0, failed_cycles=0, failed_requests=0,
                           loaded_adapters=len(model.peft_config))
        self.adapters = pool.paths()

    def add(self, **added) -> None:
        with self.lock:
            for name, n in added.items():
                self.values[name] += n

    def cycled(self, decoder, taken, before) -> None:
        """A cycle: its k, and the drafts drafted and accepted per adapter (``before``: each row's
        (drafted, accepted) before it; ``taken``: the (row, handle) pairs)."""
        with self.lock:
            v = self.values
            v["cycles"] += 1
            v["k_hist"][decoder.k] += 1
            for r, h in taken:
                v["drafted"][h.request.adapter] += decoder.rows[r].drafted - before[r][0]
                v["accepted"][h.request.adapter] += decoder.rows[r].accepted - before[r][1]

    def publish(self) -> None:
        """After an adapter change: what is served now."""
        with self.lock:
            self.adapters = self.pool.paths()
            self.values["loaded_adapters"] = len(self.model.peft_config)

    def snapshot(self, prefix) -> dict:
        """A copy of ``values``, with the pool's loads and evictions and the prefix cache's (``prefix``:
        PrefixCaching or None) prompt tokens looked up and found, blocks and bytes kept."""
        with self.lock:
            return {**{k: dict(v) if isinstance(v, dict) else v for k, v in self.values.items()},
                    "loads": self.pool.loads, "evictions": self.pool.evictions,
                    "prefix_queries": prefix.queries if prefix else 0, "prefix_hits": prefix.hits if prefix else 0,
                    "prefix_blocks": len(prefix.cache) if prefix else 0,
                    "prefix_bytes": prefix.cache.bytes if prefix else 0}
