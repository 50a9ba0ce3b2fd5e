"""The adapters a serving engine serves (engine.py), as vLLM's LoRA model manager holds them: each
served name's current revision, loaded in the model or evicted (its folder known, loaded again when
a request names it), and the old revisions rows still decode with; bounded by ``max_cpu_loras`` as
vLLM and SGLang bound the adapters they hold.

A revision is a value, ``AdapterRef(name, revision, key)``: ``key`` is the PEFT adapter name its
weights are loaded under, what the adapter bank and PEFT's layers read. A request's row holds the
ref it was admitted with, so it decodes with that revision's weights whatever happens to the name
meanwhile. The model's adapters are never renamed: a reload in place (``replace``) loads the new
revision under a key of its own (the name if it is free, else ``name#revision``, which no request
can name) beside the old one, or, when no row holds the old one and the new config builds the same
modules (a training loop's next checkpoint), writes the new weights into the old tensors. An old
revision is kept (``retired``) while rows decode with it, then deleted between cycles (``retire_unheld``).

Every command either completes or changes nothing: its one model operation comes first (peft_ops.py's
add, overwrite or remove, each all or nothing: PEFT's order of the other adapters is never touched),
and the records here change only after it, in steps that cannot fail. Files are read by ``read``,
on the caller's thread (a command's) or the reader thread (an evicted adapter's, ``prefetch``),
never on the engine's: a slow or hostile folder stalls no one else.

Eviction picks the least recently used adapter that no request decodes with or waits for (for the
load a waiting request needs, one that only requests after it wait for, if there is no other). A
swap loads the new adapter before it evicts the old one (PEFT keeps at least one adapter), so the
model holds one adapter more for a moment. An adapter found by the resolver is forgotten when it is
evicted (resolver.py): the next request that names it looks it up again.

Adapter names are what routers and gateways carry: letters, digits and ``_ - . / :``, starting
with a letter or digit, at most 128 characters (``check_name``); no commas, which
``vllm:lora_requests_info`` uses to join names, no spaces, quotes or control characters.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import gc
import itertools
import logging
import os
import re
from dataclasses import dataclass

from ..decode.checks import check_model
from ..lora.stacks import nonfinite
from ..lora.files import MAX_RANK, AdapterRefused, OutsideRoots, Unreadable, read_adapter
from ..lora.peft_ops import add_adapter, overwrite_adapter, remove_adapter, same_layout
from ..model.walk import BASE

logger = logging.getLogger("hf_invisiblelora")


class UnknownAdapter(ValueError):
    """No adapter of that name is served."""


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


@dataclass(frozen=True)
class AdapterRef:
    """One revision of a served adapter, as a row holds it: the bank and PEFT know its weights by ``key``."""

    name: str
    revision: int
    key: str


BASE_REF = AdapterRef(BASE, 0, BASE)


@dataclass
class Served:
    """A served name: its folder (None: made in-process, never evicted) and the real paths its files
    may be read under (None: anywhere), its current revision and the key its weights are loaded
    under (None: evicted), whether the resolver found it, and when it was last used."""

    path: str | None
    roots: list | None
    revision: int = 0
    key: str | None = None
    resolved: bool = False
    used: int = 0


class AdapterManager:
    """``adapter_paths``: {name: local PEFT adapter folder} for adapters the model has loaded (so that
    they can be evicted and loaded again) and for others, loaded when a request names them.
    ``loads``, ``evictions``: how many so far (the engine's metrics). See the module docstring."""

    def __init__(self, model, max_cpu_loras: int | None, adapter_paths: dict | None, max_lora_rank: int = MAX_RANK):
        paths = {name: os.fspath(path) for name, path in (adapter_paths or {}).items()}
        if BASE in paths:
            raise ValueError(f"{BASE!r} is the base model, not an adapter name.")
        for name in [*model.peft_config, *paths]:
            check_name(name)
        self.model, self.max_cpu_loras, self.max_lora_rank = model, max_cpu_loras, max_lora_rank
        self._ticks = itertools.count()
        self.served = {name: Served(paths.get(name), None, key=name if name in model.peft_config else None,
                                    used=next(self._ticks)) for name in [*model.peft_config, *paths]}
        if max_cpu_loras is not None:
            unknown = [name for name, s in self.served.items() if s.path is None]
            if len(model.peft_config) > max_cpu_loras:
                raise ValueError(f"The model has {len(model.peft_config)} adapters loaded, more than max_cpu_loras="
                                 f"{max_cpu_loras}; load fewer and give the others in adapter_paths.")
            if len(unknown) >= max_cpu_loras:
                raise ValueError(f"max_cpu_loras={max_cpu_loras} leaves no room to load an adapter besides {unknown}, "
                                 "whose paths the engine does not know (it cannot evict them); give them in "
                                 "adapter_paths.")
        self.retired = set()  # keys of old revisions kept while rows decode with them
        self.loads = self.evictions = 0
        self._reads = {}  # name -> (path, revision, Future of its files): evicted adapters read again
        self._reader = None  # the thread that reads them (made on first use)

    # --- what is served (the engine reads these on its thread, or under its lock) ---

    def __contains__(self, name) -> bool:
        return name in self.served

    def names(self) -> list[str]:
        return list(self.served)

    def paths(self) -> dict:
        """{name: its folder, or None}."""
        return {name: s.path for name, s in self.served.items()}

    def loaded(self, name: str) -> bool:
        return self.served[name].key is not None

    def ref(self, name: str) -> AdapterRef:
        """The revision a request admitted now decodes with (``name`` loaded, or the base model)."""
        if name == BASE:
            return BASE_REF
        s = self.served[name]
        return AdapterRef(name, s.revision, s.key)

    def restorable(self, name: str) -> bool:
        """Evicted, ``name`` can be had again: from its folder, or the resolver's."""
        s = self.served[name]
        return bool(s.path or s.resolved)

    def touch(self, name: str) -> None:
        if name in self.served:
            self.served[name].used = next(self._ticks)

    def held(self) -> int:
        """Adapters loaded, old revisions left out."""
        return sum(s.key is not None for s in self.served.values())

    def has_room(self) -> bool:
        """Another adapter can be loaded without evicting one."""
        return self.max_cpu_loras is None or self.held() < self.max_cpu_loras

    # --- reading (any thread but the engine's) ---

    def read(self, path: str, roots=None):
        """The adapter in folder ``path`` (files.py: inside ``roots``, the real paths its files may be
        read under, None: anywhere; its rank bounded), or AdapterUnsupported / the files' errors."""
        try:
            return read_adapter(path, self.model, roots, self.max_lora_rank)
        except (OutsideRoots, Unreadable):
            raise
        except AdapterRefused as e:
            raise AdapterUnsupported(str(e)) from e

    def prefetch(self, name: str, done) -> concurrent.futures.Future:
        """The files of evicted adapter ``name`` at its current revision, read on the reader thread;
        ``done()`` is called when they are (the engine waits for them between cycles)."""
        s = self.served[name]
        entry = self._reads.get(name)
        if entry is None or entry[:2] != (s.path, s.revision):  # none yet, or a stale one (reloaded meanwhile)
            if self._reader is None:
                self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf_invisiblelora-read")
            future = self._reader.submit(self.read, s.path, s.roots)
            future.add_done_callback(lambda _: done())
            entry = self._reads[name] = (s.path, s.revision, future)
        return entry[2]

    # --- commands (the engine's thread, between cycles) ---

    def serve(self, name: str, files, path: str, roots, inplace: bool, resolved: bool, held, running, waiting):
        """The engine's load command: ``files`` (read from ``path``) as the new name ``name``, or with
        ``inplace`` as a new revision of a served one (``replace``: ``held``, the keys rows decode with,
        says whether its current revision must be kept); then past max_cpu_loras an idle adapter is
        evicted (``fit``: ``running``, ``waiting`` the adapters rows and waiting requests name)."""
        if name == BASE or name in self and not inplace:
            raise AdapterExists(f"An adapter named {name!r} is already served (or reserved).")
        if name in self:
            self.replace(name, files, path, roots, held=self.served[name].key in held)
        else:
            self.add(name, files, path, roots, resolved)
        self.fit(name, running, waiting, idle=True)

    def unload(self, name: str, busy: int) -> None:
        """The engine's unload command: ``name`` no longer served; refused while ``busy`` requests use
        it, and for the last adapter loaded (a PEFT model keeps one)."""
        if name not in self:
            raise UnknownAdapter(f"No adapter named {name!r} is served; served: {self.names()}.")
        if self.loaded(name) and len(self.model.peft_config) == 1:
            raise LastAdapter(f"{name!r} is the last adapter loaded; a PEFT model keeps at least one.")
        if busy:
            raise AdapterBusy(f"Adapter {name!r} is in use by {busy} request(s); unload it when they are done.")
        self.forget(name)

    def add(self, name: str, files, path: str, roots=None, resolved: bool = False) -> None:
        """Serve the read adapter ``files`` as the new name ``name`` (from folder ``path``)."""
        key = self._load(name, 0, files)
        self.served[name] = Served(path, roots, 0, key, resolved, next(self._ticks))

    def reload(self, name: str) -> None:
        """Load evicted adapter ``name``'s current revision again, from the files ``prefetch`` read
        (done): their read's error if it failed (the next ``prefetch`` reads them again)."""
        s = self.served[name]
        key = self._load(name, s.revision, self._reads.pop(name)[2].result())
        s.key, s.used = key, next(self._ticks)

    def replace(self, name: str, files, path: str, roots=None, held: bool = True) -> None:
        """``files`` as a new revision of served adapter ``name`` (a reload in place, from folder
        ``path``). ``held``: rows decode with the current revision, which is then kept (``retired``)
        until the engine retires it; else it is deleted, or overwritten when the new config builds
        its modules. A load that fails leaves everything as it was."""
        s = self.served[name]
        old = s.key
        if not held and old is not None and same_layout(self.model, old, files.config):
            overwrite_adapter(self.model, old, files, self._servable(old))
            self.loads += 1
            key, old = old, None
        else:
            key = self._load(name, s.revision + 1, files)
        s.path, s.roots, s.revision, s.key, s.used = path, roots, s.revision + 1, key, next(self._ticks)
        s.resolved = False  # the operator's folder now: evicted, it is loaded from there again
        self._reads.pop(name, None)
        if old is not None:
            self.retired.add(old)
            if not held:
                self.retire(old)

    def retirable(self, held) -> bool:
        """Whether an old revision is kept that no row decodes with any more (``held``: the keys rows hold)."""
        return any(key not in held for key in self.retired)

    def retire_unheld(self, held) -> bool:
        """Delete the old revisions no row holds (``held``); whether one was. A deletion that fails is
        logged, and the revision stays in the model unused (serving goes on)."""
        done = [key for key in self.retired if key not in held]
        for key in done:
            try:
                self.retire(key)
            except Exception:  # noqa: BLE001 - the engine serves on
                logger.exception("hf_invisiblelora engine: deleting old revision %r failed", key)
                self.retired.discard(key)
        return bool(done)

    def retire(self, key: str) -> None:
        """Delete an old revision (no row decodes with it any more)."""
        remove_adapter(self.model, key)
        self.retired.discard(key)

    def forget(self, name: str) -> None:
        """Stop serving ``name`` (its current revision deleted from the model if loaded)."""
        s = self.served[name]
        if s.key is not None:
            remove_adapter(self.model, s.key)
        del self.served[name]
        self._reads.pop(name, None)

    def evictable(self, keep: str, running, waiting, idle: bool) -> list[str]:
        """Loaded adapters that may be evicted now, the best first: not ``keep``, not in ``running``
        (the batch's rows read them), that can be had again (a known folder, or the resolver's);
        ``idle``: nor any in ``waiting`` (the adapters waiting requests name; never one the resolver
        found, which evicting forgets). Those no waiting request names first, then least recently used."""
        return sorted((a for a, s in self.served.items() if s.key is not None and a != keep and a not in running
                       and self.restorable(a) and not ((idle or s.resolved) and a in waiting)),
                      key=lambda a: (a in waiting, self.served[a].used))

    def fit(self, loaded: str, running, waiting, idle: bool) -> str | None:
        """After loading ``loaded``: if that makes one adapter more than max_cpu_loras, evict the
        first of ``evictable`` (``loaded`` itself when there is none); returns the evicted one. An
        eviction that fails is logged and leaves the victim loaded: the load it follows stands."""
        if self.max_cpu_loras is None or self.held() <= self.max_cpu_loras:
            return None
        victim = next(iter(self.evictable(loaded, running, waiting, idle)), loaded)
        s = self.served[victim]
        try:
            if s.resolved:
                self.forget(victim)
            else:
                remove_adapter(self.model, s.key)
                s.key = None
        except Exception:  # noqa: BLE001 - the load stands; the victim stays loaded, one past the bound until the next
            logger.exception("hf_invisiblelora engine: evicting adapter %r failed; it stays loaded", victim)
            return None
        self.evictions += 1
        logger.info("hf_invisiblelora engine: evicted adapter %r (max_cpu_loras=%d)", victim, self.max_cpu_loras)
        return victim

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
            self._reader = None

    def _load(self, name: str, revision: int, files) -> str:
        """``files`` added to the model under a key of their own (the name if free, else
        ``name#revision``), checked servable; on any failure the model as it was. Returns the key."""
        key, n = name, revision
        while key in self.model.peft_config:
            key, n = f"{name}#{n}", n + 1
        try:
            add_adapter(self.model, key, files, self._servable(key))
        except BaseException:
            return_freed_memory()
            raise
        self.loads += 1
        return key

    def _servable(self, key: str):
        """The check of the adapter loaded under ``key`` (it raises AdapterUnsupported)."""
        def servable():
            try:
                check_model(self.model)
            except ValueError as e:
                raise AdapterUnsupported(str(e)) from e
            bad = nonfinite(self.model, key)
            if bad is not None:
                raise AdapterUnsupported(f"its values are not finite in {bad} (B * scaling overflows, or a DoRA "
                                         "scale): its outputs would be undefined")
        return servable


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
