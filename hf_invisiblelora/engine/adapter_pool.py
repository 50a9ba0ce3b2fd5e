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

A reload in place (``replace``) gives a loaded adapter new weights under its name, a new revision:
its old weights are renamed to an internal name (``name#revision``, which no request can name) and
kept while rows that started on them decode (the engine retires them after: ``retire``), so a
request finishes on the revision it started with. Retired adapters do not count against
``max_cpu_loras``.

Loading reads the folder through files.py (inside the allowed roots at each file's read,
the rank bounded by ``max_lora_rank`` before anything is allocated, finite values only) and puts
the adapter into the model or nothing: a load that fails at any point leaves the model's modules
as they were, and its memory is handed back.

Adapter names are what routers and gateways carry: letters, digits and ``_ - . / :``, starting
with a letter or digit, at most 128 characters (``check_name``); no commas, which
``vllm:lora_requests_info`` uses to join names, no spaces, quotes or control characters.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import os
import re

from ..decode.checks import check_model
from ..lora.bank import nonfinite
from ..lora.files import (
    MAX_RANK,
    AdapterRefused,
    OutsideRoots,
    Unreadable,
    add_adapter,
    overwrite_adapter,
    read_adapter,
    remove_adapter,
    rename_adapter,
    same_layout,
)
from ..model.walk import BASE

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
    """The adapter cannot be served (its folder, its rank or values, or checks.check_model say why); the
    model is as it was."""


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")


def check_name(name) -> None:
    """A ValueError unless ``name`` is an adapter name the engine serves (the module docstring)."""
    if not (isinstance(name, str) and NAME.fullmatch(name)) or name == BASE:
        raise ValueError(f"Adapter names are 1-128 letters, digits and _ - . / : (starting with a letter or digit; "
                         f"not {BASE!r}); got {name!r}.")


class AdapterPool:
    """``paths``: every adapter served -> its folder (None: unknown, so it is never evicted);
    ``adapter_paths``: {name: local PEFT adapter folder} for adapters the model has loaded (so that
    they can be evicted and loaded again) and for others, loaded when a request names them.
    ``loads``, ``evictions``: how many so far (the engine's metrics)."""

    def __init__(self, model, max_cpu_loras: int | None, adapter_paths: dict | None, max_lora_rank: int = MAX_RANK):
        paths = {name: os.fspath(path) for name, path in (adapter_paths or {}).items()}
        if BASE in paths:
            raise ValueError(f"{BASE!r} is the base model, not an adapter name.")
        for name in [*model.peft_config, *paths]:
            check_name(name)
        self.model, self.max_cpu_loras, self.max_lora_rank = model, max_cpu_loras, max_lora_rank
        self.paths = {**{name: None for name in model.peft_config}, **paths}
        self.roots = {}  # name -> the roots its files must be read under (absent: anywhere)
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
        self.revision = dict.fromkeys(self.paths, 0)  # adapter -> reloads in place so far
        self.retired = set()  # old revisions kept while rows decode with them (``replace``)
        self._ticks = itertools.count()
        self.used = {name: next(self._ticks) for name in self.paths}  # adapter -> when last used (LRU)

    def __contains__(self, name) -> bool:
        return name in self.paths

    def loaded(self, name: str) -> bool:
        return name in self.model.peft_config

    def touch(self, name: str) -> None:
        self.used[name] = next(self._ticks)

    def held(self) -> int:
        """Adapters loaded, retired revisions left out."""
        return len(self.model.peft_config) - len(self.retired)

    def has_room(self) -> bool:
        """Another adapter can be loaded without evicting one."""
        return self.max_cpu_loras is None or self.held() < self.max_cpu_loras

    def load(self, name: str, path: str, roots=None) -> None:
        """Load an adapter into the model (see the module docstring); ``roots``: the real paths its
        files must be read under (None: anywhere), kept for loading it again after an eviction. One
        that cannot be read or served raises AdapterUnsupported, and one PEFT fails to load its own
        error; either way the model is as it was."""
        roots = self.roots.get(name) if roots is None else roots
        self._add(name, self._read(path, roots), roots)

    def _add(self, name: str, files, roots) -> None:
        try:
            add_adapter(self.model, name, files, self._servable(name))
        except BaseException:
            del files
            return_freed_memory()
            raise
        self._loaded(name, roots)

    def _read(self, path: str, roots):
        try:
            return read_adapter(path, self.model, roots, self.max_lora_rank)
        except (OutsideRoots, Unreadable):
            raise
        except AdapterRefused as e:
            raise AdapterUnsupported(str(e)) from e

    def _servable(self, name: str):
        """The check of a loaded adapter ``name`` (it raises AdapterUnsupported)."""
        def servable():
            try:
                check_model(self.model)
            except ValueError as e:
                raise AdapterUnsupported(str(e)) from e
            bad = nonfinite(self.model, name)
            if bad is not None:
                raise AdapterUnsupported(f"its values are not finite in {bad} (B * scaling overflows, or a DoRA "
                                         "scale): its outputs would be undefined")
        return servable

    def _loaded(self, name: str, roots) -> None:
        if roots is not None:
            self.roots[name] = roots
        self.touch(name)
        self.loads += 1

    def replace(self, name: str, path: str, roots=None, keep_old: bool = True) -> str | None:
        """Load ``path``'s adapter as a new revision of the loaded adapter ``name`` (a reload in place):
        the old weights renamed to ``name#revision``, returned and kept (``retired``) if ``keep_old``
        (rows decode with them), else deleted; or, when no row holds them and the new config builds
        the same modules (a training loop's next checkpoint), the new weights written into the old
        tensors (lora/files.overwrite_adapter: PEFT's injection skipped). A load that fails leaves the
        old revision as it was."""
        revision = self.revision.get(name, 0)
        roots = self.roots.get(name) if roots is None else roots
        files = self._read(path, roots)
        # No row holds the old weights and the new ones fit its modules: they take their place.
        if not keep_old and same_layout(self.model, name, files.config):
            overwrite_adapter(self.model, name, files, self._servable(name))
            self._loaded(name, roots)
            self.paths[name], self.revision[name] = path, revision + 1
            return None
        old = f"{name}#{revision}"
        rename_adapter(self.model, name, old)
        self.retired.add(old)
        try:
            self._add(name, files, roots)
        except BaseException:
            rename_adapter(self.model, old, name)
            self.retired.discard(old)
            raise
        self.paths[name], self.revision[name] = path, revision + 1
        if keep_old:
            return old
        self.retire(old)
        return None

    def retire(self, old: str) -> None:
        """Delete a retired revision (no row decodes with it any more)."""
        self.retired.discard(old)
        self.delete(old)

    def delete(self, name: str) -> None:
        remove_adapter(self.model, name)

    def forget(self, name: str) -> None:
        """Stop serving ``name`` (deleted from the model if loaded)."""
        if self.loaded(name):
            self.delete(name)
        del self.paths[name], self.used[name]
        self.roots.pop(name, None)
        self.revision.pop(name, None)

    def evictable(self, keep: str, running, waiting, idle: bool) -> list[str]:
        """Loaded adapters that may be evicted now, the best first: not ``keep``, not in ``running``
        (the batch's rows read them), with a known path (to load them again); ``idle``: nor any in
        ``waiting`` (the adapters waiting requests name). Those no waiting request names first, then
        least recently used."""
        return sorted((a for a in self.model.peft_config if a != keep and a not in running and self.paths.get(a)
                       and a not in self.retired and not (idle and a in waiting)),
                      key=lambda a: (a in waiting, self.used[a]))

    def fit(self, loaded: str, running, waiting, idle: bool) -> str | None:
        """After loading ``loaded``: if that makes one adapter more than max_cpu_loras, evict the
        first of ``evictable`` (``loaded`` itself when there is none); returns the evicted one."""
        if self.max_cpu_loras is None or self.held() <= self.max_cpu_loras:
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
    gc.collect()  # a failed load's modules can sit in a reference cycle with its traceback
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass
