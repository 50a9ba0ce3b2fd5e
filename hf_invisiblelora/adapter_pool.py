"""The adapters a serving engine serves (engine.py): those the model has loaded and those evicted
that it can load again (their folders), with when each was last used, bounded by
``max_cpu_loras`` as vLLM and SGLang bound the adapters they hold. Used on the engine's thread.

The engine keeps the path of every adapter it serves (``load_adapter``, and ``adapter_paths`` for
those given at construction, loaded or not): when a load would go past the bound it evicts the
least recently used adapter that no request decodes with or waits for (for the load a waiting
request needs, one that only requests after it wait for, if there is no other), and an evicted
adapter is loaded again, between cycles, when a request names it. A swap loads the new adapter
before it evicts the old one (a failed load changes nothing, and PEFT keeps at least one adapter),
so the model holds one adapter more for a moment.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os

from .checks import check_model
from .lora import BASE

logger = logging.getLogger("hf_invisiblelora")


class UnknownAdapter(ValueError):
    """No adapter of that name is loaded."""


class AdapterBusy(RuntimeError):
    """The adapter cannot be unloaded now: requests use it."""


class LastAdapter(AdapterBusy):
    """The adapter cannot be unloaded: a PEFT model keeps at least one."""


class AdapterExists(ValueError):
    """An adapter of that name is served already (or the name is reserved)."""


class AdapterUnsupported(ValueError):
    """The adapter loaded, but the engine cannot serve it (checks.check_model says why); it was removed."""


class AdapterPool:
    """``paths``: every adapter served -> its folder (None: unknown, so it is never evicted);
    ``adapter_paths``: {name: local PEFT adapter folder} for adapters the model has loaded (so that
    they can be evicted and loaded again) and for others, loaded when a request names them.
    ``loads``, ``evictions``: how many so far (the engine's metrics)."""

    def __init__(self, model, max_cpu_loras: int | None, adapter_paths: dict | None):
        paths = {name: os.fspath(path) for name, path in (adapter_paths or {}).items()}
        if BASE in paths:
            raise ValueError(f"{BASE!r} is the base model, not an adapter name.")
        self.model, self.max_cpu_loras = model, max_cpu_loras
        self.paths = {**{name: None for name in model.peft_config}, **paths}
        if max_cpu_loras is not None:
            unknown = [name for name in model.peft_config if self.paths[name] is None]
            if len(model.peft_config) > max_cpu_loras:
                raise ValueError(f"The model has {len(model.peft_config)} adapters loaded, more than max_cpu_loras="
                                 f"{max_cpu_loras}; load fewer and give the others in adapter_paths.")
            if len(unknown) >= max_cpu_loras:
                raise ValueError(f"max_cpu_loras={max_cpu_loras} leaves no room to load an adapter besides {unknown}, "
                                 "whose paths the engine does not know (it cannot evict them); give them in "
                                 "adapter_paths.")
        self.loads = self.evictions = 0
        self._ticks = itertools.count()
        self.used = {name: next(self._ticks) for name in self.paths}  # adapter -> when last used (LRU)

    def __contains__(self, name) -> bool:
        return name in self.paths

    def loaded(self, name: str) -> bool:
        return name in self.model.peft_config

    def touch(self, name: str) -> None:
        self.used[name] = next(self._ticks)

    def has_room(self) -> bool:
        """Another adapter can be loaded without evicting one."""
        return self.max_cpu_loras is None or len(self.model.peft_config) < self.max_cpu_loras

    def load(self, name: str, path: str) -> None:
        """Load an adapter into the model; one PEFT fails to load or the engine cannot serve
        (checks.check_model) is removed again: then the model is as it was."""
        try:
            self.model.load_adapter(path, adapter_name=name)
            self.model.eval()
            try:
                check_model(self.model)
            except ValueError as e:
                raise AdapterUnsupported(str(e)) from e
        except Exception:
            if name in self.model.peft_config:
                self.delete(name)
            raise
        self.touch(name)
        self.loads += 1

    def delete(self, name: str) -> None:
        """PEFT's delete_adapter, another adapter made the active one first if ``name`` is: PEFT takes
        the next one from its first LoRA layer, and where that layer holds no other, the model's
        active adapter stays the deleted one (then every PEFT call on the model fails)."""
        if name in self.model.active_adapters:
            self.model.set_adapter(next(a for a in self.model.peft_config if a != name), inference_mode=True)
        self.model.delete_adapter(name)

    def forget(self, name: str) -> None:
        """Stop serving ``name`` (deleted from the model if loaded)."""
        if self.loaded(name):
            self.delete(name)
        del self.paths[name], self.used[name]

    def evictable(self, keep: str, running, waiting, idle: bool) -> list[str]:
        """Loaded adapters that may be evicted now, the best first: not ``keep``, not in ``running``
        (the batch's rows read them), with a known path (to load them again); ``idle``: nor any in
        ``waiting`` (the adapters waiting requests name). Those no waiting request names first, then
        least recently used."""
        return sorted((a for a in self.model.peft_config if a != keep and a not in running and self.paths.get(a)
                       and not (idle and a in waiting)), key=lambda a: (a in waiting, self.used[a]))

    def fit(self, loaded: str, running, waiting, idle: bool) -> str | None:
        """After loading ``loaded``: if that makes one adapter more than max_cpu_loras, evict the
        first of ``evictable`` (``loaded`` itself when there is none); returns the evicted one."""
        if self.max_cpu_loras is None or len(self.model.peft_config) <= self.max_cpu_loras:
            return None
        victim = next(iter(self.evictable(loaded, running, waiting, idle)), loaded)
        self.delete(victim)
        self.evictions += 1
        logger.info("hf_invisiblelora engine: evicted adapter %r (max_cpu_loras=%d)", victim, self.max_cpu_loras)
        return victim


def return_freed_memory() -> None:
    """Hand the free pages of the C heap back to the OS (glibc's malloc_trim), after an adapter change
    freed the old adapter bank.

    Torch allocates the bank's stacks (many of 0.1-1 MB) from malloc's heap; glibc returns its free
    memory to the OS only from the top of the heap, so the holes a freed bank leaves stay resident.
    Measured on SmolLM2 with its zoo (2 CPUs): loading 11 more adapters grew the RSS by 770 MB, of
    which 475 MB were free in the heap; malloc_trim(0) after each change returned them, in 40-120 ms."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass
