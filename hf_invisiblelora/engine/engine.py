"""Continuous batching: requests join free rows of one shared cache between cycles and leave as soon
as they are done, each with its own adapter and sampling settings (the OpenAI-compatible server in
serving/ runs on it; it is a plain object and needs no HTTP).

    engine = Engine(peft_model, max_batch=8)
    engine.start()
    handle = engine.submit(Request(prompt_ids, adapter="poetry", max_tokens=64, temperature=0.7, seed=1))
    for tokens in handle:            # committed tokens, as the cycles commit them
        ...
    handle.finish_reason             # "stop" (EOS or stopped by the caller) or "length"
    engine.stop()

Split as vLLM v1 splits its engine: this module is the client API and the engine's thread loop;
which waiting requests join the rows and how their prompts get into the cache is the scheduler's
(scheduler.py); what is served, its revisions and their bounds the adapter manager's (adapters.py);
a cycle's passes the decoder's (decode/decoder.py); the requests in the rows and what a cycle's
tokens do to them ``Rows`` (rows.py).

Each loop the engine admits waiting requests into free rows, runs the next chunk of a long prompt,
then one decoder cycle (the gate's drafts, one verify pass over every active row, acceptance) and
hands each request its committed tokens. A request's output does not depend on what else shares the
batch: greedy output equals standalone ``generate()`` of its prompt with its adapter, and sampling
with a seed gives the same tokens whatever the batch (policies.RequestPolicy). An unexpected
exception in a prefill, a cycle or a delivery ends only the requests in it (finish reason "error";
logged, and counted in ``metrics``: ``failed_cycles``, ``failed_requests``); their rows are freed and
the engine serves on.

Adapters can be loaded, reloaded in place and unloaded while serving (commands, run between cycles;
unloading one that a request uses is refused). A command either takes effect or changes nothing:
adapters.py makes its one model operation first and its records after. An adapter's folder is read on
the caller's thread (an evicted one's on adapters.py's reader thread), never on the engine's, so no
file stalls serving. The engine holds the model's InvisibleLoRA lock while it runs: other
``generate(invisible_lora=True)`` calls on the model wait until it stops.

What it holds is bounded, as vLLM and SGLang bound it (options.Limits): ``max_loras`` distinct
adapters in one pass (a request whose adapter would be one too many waits) and ``max_cpu_loras``
adapters loaded in the model (the least recently used idle one is evicted and loaded again when a
request names it), by default ``max_loras`` (else ``max_batch``) or what the model holds at start,
and one more.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import threading

import torch

from ..decode.checks import check_adapter_state, check_model
from ..decode.decoder import Decoder
from ..decode.drafters import fixed_vocabulary
from ..decode.low_precision import draft_dtypes
from ..decode.policies import RequestPolicy
from ..decode.session import Session, lora_backend, make_drafters
from ..lora.files import MAX_RANK
from ..model.rotary import length_dependent
from ..model.state import state_of
from ..model.walk import BASE
from ..options import PREFILL_CHUNK, Limits, Options
from ..threads import release_openmp_threads
from .adapters import (
    NAME,
    AdapterBusy,
    AdapterExists,
    AdapterManager,
    AdapterUnsupported,
    LastAdapter,
    UnknownAdapter,
    check_name,
    return_freed_memory,
)
from .counters import Counters
from .request import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, Handle, InvalidRequest, PromptTooLong, Request, Status, validate
from .resolver import AdapterResolver
from .scheduler import Scheduler

logger = logging.getLogger("hf_invisiblelora")
__all__ = ["Engine", "PREFILL_CHUNK", "Request", "Handle", "Status", "MAX_LOGPROBS", "MAX_STOP_TOKEN_IDS",
           "InvalidRequest", "PromptTooLong", "QueueFull", "NotRunning", "UnknownAdapter", "AdapterBusy", "LastAdapter",
           "AdapterExists", "AdapterUnsupported"]


class QueueFull(RuntimeError):
    """The engine's queue holds ``max_queue`` requests already."""


class NotRunning(RuntimeError):
    """The engine is not running (not started, stopped, or failed)."""


class Engine:
    """A fixed number of rows (``max_batch``) over one shared cache of ``max_len`` slots per row
    (prompt + new tokens + drafts). See the module docstring."""

    def __init__(self, model, max_batch: int = 8, max_len: int = 1024, num_draft_tokens: int = 4,
                 gate: str = "auto", max_queue: int = 1024, max_loras: int | None = None,
                 max_cpu_loras: int | None = None, adapter_paths: dict | None = None, draft_vocab=None,
                 draft_dtype="auto", prompt_lookup: bool = True, prepack="auto",
                 prefill_chunk: int | None = PREFILL_CHUNK, max_lora_rank: int = MAX_RANK, prefix_caching: bool = True,
                 prefix_cache_bytes: int | None = None, lora_resolver_dirs=()):
        """The decoding options as generate() takes them (options.Options; an int ``draft_vocab``: the
        most frequent tokens earlier generate(invisible_lora=True) calls on the model have seen) and
        the bounds (options.Limits; prefix caching: prefix_cache.py). ``adapter_paths``: {name: local
        PEFT adapter folder}, for adapters the model has loaded (so that they can be evicted and loaded
        again) and for others, loaded when a request names them. ``lora_resolver_dirs``: folders where
        an adapter a request names and the engine does not serve is looked up (``resolve``)."""
        self.options = Options(num_draft_tokens=num_draft_tokens, gate=gate, compile=False, draft_vocab=draft_vocab,
                               draft_dtype=draft_dtype, prompt_lookup=prompt_lookup, prepack=prepack)
        limits = Limits(max_batch=max_batch, max_len=max_len, max_queue=max_queue, max_loras=max_loras,
                        max_cpu_loras=max_cpu_loras, max_lora_rank=max_lora_rank, prefill_chunk=prefill_chunk,
                        prefix_caching=prefix_caching, prefix_cache_bytes=prefix_cache_bytes)
        if max_cpu_loras is None:  # vLLM's default is max_loras; room for what the model holds, and one more
            limits = dataclasses.replace(limits, max_cpu_loras=max(max_loras or max_batch, len(model.peft_config) + 1))
        self.limits = limits
        check_model(model)
        check_adapter_state(model, [], mixed=True)  # no dropout in training mode anywhere
        inner = model.get_base_model()
        if any(length_dependent(m) for m in inner.modules()):
            raise ValueError("The serving engine does not support rotary embeddings that depend on the sequence "
                             "length (dynamic NTK, LongRoPE): their frequencies follow the batch's longest row.")
        self.model, self.inner, self.state = model, inner, state_of(model)
        self.vocab_size = inner.get_input_embeddings().weight.shape[0]  # also under a LoRA or modules_to_save wrapper
        self.draft_vocab = fixed_vocabulary(draft_vocab, self.state, inner, self.vocab_size)  # (ids or None, size)
        self.draft_dtypes = draft_dtypes(draft_dtype, model)
        self.max_positions = getattr(inner.config.get_text_config(decoder=True), "max_position_embeddings", None)
        eos = inner.generation_config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])  # unless ignore_eos, a request's stops
        self.pad_id = inner.generation_config.pad_token_id or (self.eos_ids[0] if self.eos_ids else 0)
        self.error = None  # what stopped the engine's thread, if it failed
        self.resolver = AdapterResolver(lora_resolver_dirs) if lora_resolver_dirs else None
        self._waiting = collections.deque()
        self._commands = queue.Queue()
        self._wake = threading.Condition()  # the queue, the commands and the pool's names: submit() checks under it
        self._cancelled = set()
        self._thread, self._running = None, False
        self._decoder = None  # the engine thread's Decoder while it runs (read by tests)
        self._nudges = 0  # submissions and cancels so far: an engine waiting for an adapter's files looks again
        self._pool = AdapterManager(model, limits.max_cpu_loras, adapter_paths, limits.max_lora_rank)
        self._counters = Counters(self._pool, model)  # what other threads read: metrics, the adapters served
        self.metrics = self._counters.values
        self._policy = RequestPolicy(max_batch, inner.device)
        self._scheduler = Scheduler(limits, num_draft_tokens, self.pad_id, inner.device, self._waiting, self._wake,
                                    self._pool, self._policy, self._counters.add,
                                    lambda r: self.stop_ids(r.ignore_eos, r.stop_token_ids))
        self._rows = self._scheduler.rows

    # --- the client side (any thread) ---

    def submit(self, request: Request) -> Handle:
        """Queue a request; it joins a free row at the next cycle. Bad requests raise ValueError;
        a full queue raises QueueFull; an engine that is not running (or failed) raises RuntimeError."""
        self.validate(request)
        handle = Handle(request, self)
        with self._wake:
            if not self.alive:
                raise NotRunning(f"The engine is not running{f' (it failed: {self.error})' if self.error else ''}.")
            if request.adapter != BASE and request.adapter not in self._pool:  # unloaded meanwhile
                raise UnknownAdapter(f"Unknown adapter {request.adapter!r}; served: {self._pool.names()}.")
            if len(self._waiting) >= self.limits.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.limits.max_queue}); "
                                "retry later.")
            self._waiting.append(handle)
            self._nudges += 1
            self._wake.notify()
        return handle

    @property
    def alive(self) -> bool:
        """The engine's thread is serving."""
        return self._running and self._thread is not None and self._thread.is_alive()

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest (a ValueError) naming the field that is wrong with ``request``
        (request.validate), or UnknownAdapter; normalizes its numbers' types. An adapter not served
        is looked up and loaded first where ``lora_resolver_dirs`` are set (``resolve``: its load's
        errors are raised here)."""
        validate(request, self.vocab_size, self.max_request_tokens)
        if request.adapter != BASE and request.adapter not in self._pool and not self.resolve(request.adapter):
            raise UnknownAdapter(f"Unknown adapter {request.adapter!r}; served: {self.adapters()}.")

    def resolve(self, name: str) -> bool:
        """Whether adapter ``name`` is served, once looked up in ``lora_resolver_dirs`` and loaded from
        the first that holds it (resolver.py, inside that folder). Concurrent calls for one name share
        one lookup and load: True, False (found nowhere), or its load's error (AdapterUnsupported and
        the files' errors: the folder holds no adapter this engine serves). Blocks for the load: call
        it off an event loop."""
        if name in self._pool:
            return True
        if self.resolver is None or name == BASE or not NAME.fullmatch(name):  # a name no adapter can have
            return False

        def load(name, folder, root):
            try:
                self._load(name, folder, [root], inplace=False, resolved=True)
                logger.info("hf_invisiblelora engine: adapter %r found in %s and loaded", name, folder)
            except AdapterExists:  # loaded meanwhile by another route
                pass
        return self.resolver.resolve(name, load)

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + new tokens a request may have: a row's slots less the drafts' room, and
        the model's position limit."""
        room = self.limits.max_len - self.options.num_draft_tokens - 1
        return min(room, self.max_positions or self.limits.max_len)

    def stop_ids(self, ignore_eos: bool, stop_token_ids) -> list[int]:
        """The token ids that end a request: the model's EOS ids (unless ignore_eos) and its stop_token_ids."""
        return list(dict.fromkeys(([] if ignore_eos else self.eos_ids) + list(stop_token_ids)))

    def adapters(self) -> list[str]:
        """Every adapter the engine serves, loaded or evicted (loaded again when a request names it)."""
        return list(self.adapter_paths())

    def adapter_paths(self) -> dict:
        """{adapter served: the folder its current revision was read from, or None (made in-process)}."""
        with self._counters.lock:
            return dict(self._counters.adapters)

    def metrics_snapshot(self) -> dict:
        """A copy of ``metrics`` (counters.py) with the adapters' loads and evictions and the prefix cache's."""
        return self._counters.snapshot(self._scheduler.prefix)

    def queue_length(self) -> int:
        return len(self._waiting)

    def adapters_in_use(self) -> tuple[list[str], list[str]]:
        """(the adapters of the requests in rows, those of the waiting requests), each name once in
        order of first use, the base model's rows left out: what a router reads for adapter affinity."""
        with self._wake:
            waiting = [h.request.adapter for h in self._waiting]
        return [list(dict.fromkeys(a for a in names if a != BASE)) for names in (self._rows.adapters(), waiting)]

    def running(self) -> int:
        return len(self._rows.taken())

    def load_adapter(self, name: str, path: str, timeout: float = 600, roots=None, inplace: bool = False) -> None:
        """Load a PEFT adapter between cycles; its folder read here, on the caller's thread, inside
        ``roots`` (the real paths its files may be read under; None: anywhere). One the engine cannot
        read or serve is refused (AdapterUnsupported, the files' errors) and nothing changes. Past
        ``max_cpu_loras`` the least recently used idle adapter is evicted (this one if every other is
        in use). ``inplace`` (vLLM's ``load_inplace``): a served name's new revision; requests in a
        row finish on theirs (``Handle.revision``). adapters.py has the details."""
        self._load(name, path, roots, inplace, resolved=False, timeout=timeout)

    def _load(self, name: str, path, roots, inplace: bool, resolved: bool, timeout: float = 600) -> None:
        check_name(name)
        path = os.fspath(path)
        if not self.alive:
            raise NotRunning("The engine is not running.")
        files = self._pool.read(path, roots)  # here: a folder never stalls the engine's thread
        self._command(lambda: self._pool.serve(name, files, path, roots, inplace, resolved, set(self._decoder.names),
                                               set(self._rows.adapters()), self._waiting_adapters()), timeout)

    def unload_adapter(self, name: str, timeout: float = 600) -> None:
        """Unload an adapter between cycles (an evicted one too: the engine forgets it); refused while
        a request uses it, and for the last one loaded."""
        def unload():
            with self._wake:  # submit() checks the adapter and queues a request under the same lock
                busy = [a for a in [h.request.adapter for h in self._waiting] + self._rows.adapters() if a == name]
                self._pool.unload(name, len(busy))
        self._command(unload, timeout)

    def _command(self, fn, timeout):
        if not self.alive:
            raise NotRunning("The engine is not running.")
        done, box = threading.Event(), {}
        with self._wake:
            self._commands.put((fn, done, box))
            self._wake.notify()
        if not done.wait(timeout):
            raise TimeoutError("the engine did not run the command in time")
        if "error" in box:
            raise box["error"]

    def _cancel(self, handle: Handle) -> None:
        with self._wake:
            if handle in self._waiting:
                self._waiting.remove(handle)
                handle._finish("cancelled")
            else:
                self._cancelled.add(handle.request.id)
            self._nudges += 1
            self._wake.notify()

    def start(self) -> "Engine":
        release_openmp_threads()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="hf_invisiblelora-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60) -> None:
        """Stop serving; requests still waiting or decoding finish as "cancelled"."""
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._end_all("cancelled")
        self._fail_commands(NotRunning("The engine stopped before running the command."))
        if self._thread is None or not self._thread.is_alive():  # no row decodes: the model keeps no old revision
            for old in list(self._pool.retired):
                self._pool.retire(old)
            self._pool.close()

    def _end_all(self, reason: str, error: str | None = None) -> None:
        """Every request waiting or in a row ends (the engine stopped or failed)."""
        with self._wake:
            for h in list(self._waiting) + [h for _, h in self._rows.taken()]:
                h._finish(reason, error)
            self._waiting.clear()

    def _fail_commands(self, error: Exception) -> None:
        while not self._commands.empty():
            _, done, box = self._commands.get()
            box["error"] = error
            done.set()

    # --- the engine's thread ---

    def _session(self) -> Session:
        """The decoder's assembly (session.py): every row its own request (RequestPolicy) and adapter."""
        o, rows = self.options, self.limits.max_batch
        drafters = make_drafters(self.model, self.state, self.draft_dtypes, *self.draft_vocab,
                                 prompt_lookup=o.prompt_lookup, drafting=o.gate != "never")
        return Session(self.model, self.state, self._policy, capacity=rows, width=self.limits.max_len, mixed=True,
                       lora_backend=lora_backend(self.model, self.model.peft_config), gate=o.gate,
                       num_draft_tokens=o.num_draft_tokens, drafters=drafters, prepack=o.prepack,
                       pad_id=self.pad_id, history=False, together=False,
                       eos=torch.full((rows, max(len(self.eos_ids), 1)), -1, device=self.inner.device))

    def _run(self) -> None:
        try:
            with self.state.hold(), torch.no_grad():
                session = self._session()
                self._decoder = session.decoder
                self._scheduler.start(session, self.model)
                while self._running:
                    with session.installed() as decoder:
                        needed = self._serve(decoder)
                    if self._run_commands() | self._reload(needed) | self._pool.retire_unheld(decoder.names):
                        session.renew_lora(self.model, lora_backend(self.model, self.model.peft_config))
                        if self._scheduler.prefix is not None:
                            self._scheduler.prefix.renew(session.check)
                        return_freed_memory()
        except Exception as e:  # noqa: BLE001 - every request learns the engine failed
            logger.exception("hf_invisiblelora engine failed")
            self.error = f"{type(e).__name__}: {e}"
            with self._wake:
                self._running = False
            self._end_all("error", self.error)
            self._fail_commands(NotRunning(f"The engine failed: {self.error}"))

    def _serve(self, decoder: Decoder) -> str | None:
        """Cycles until a command (an adapter change) arrives, the engine stops, or the first
        waiting request needs an evicted adapter loaded and its files are read (its name is
        returned; until they are, the rows decode on, or the engine waits)."""
        scheduler = self._scheduler
        while True:
            with self._wake:
                while self._running and self._commands.empty() and not self._waiting and not self.running() \
                        and not self._pool.retirable(decoder.names):
                    self._wake.wait()
            if not self._commands.empty() or not self._running or self._pool.retirable(decoder.names):
                return None
            with self._wake:
                cancelled, self._cancelled, nudges = self._cancelled, set(), self._nudges
            self._rows.drop(decoder, cancelled)
            needed = scheduler.admit(decoder)
            if needed is not None and self._pool.prefetch(needed, self._notify).done():
                return needed
            # The next chunk of prompt slots rides in the cycle's verify pass; alone if no row decodes.
            joining = scheduler.next_chunk(decoder, fold=bool(decoder.batch.active))
            if decoder.batch.active:
                self._cycle(decoder, joining)
            elif needed is not None and not scheduler.chunked:  # nothing to do but wait for its files
                with self._wake:
                    while self._running and self._commands.empty() and self._nudges == nudges and \
                            not self._pool.prefetch(needed, self._notify).done():
                        self._wake.wait()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _cycle(self, decoder: Decoder, joining=None) -> None:
        """One decoder cycle over the active rows, then delivery (Scheduler.cycled); ``joining``
        ((group, start, end) of ``next_chunk``): a chunk of a group's prompt slots in its verify pass.
        If it raises, the requests in it end with "error" and the engine serves on."""
        try:
            before = [(row.drafted, row.accepted) for row in decoder.rows]
            committed = decoder.cycle(None if joining is None else ([r for r, _ in joining[0]], *joining[1:]))
            self._counters.cycled(decoder, self._rows.taken(), before)
        except Exception as e:  # noqa: BLE001 - every row of the cycle is involved; the engine serves on
            self._scheduler.failed(decoder, joining, e)
            return
        self._scheduler.cycled(decoder, joining, committed)

    def _run_commands(self) -> bool:
        """Run the queued adapter changes; True if one took effect (a refused or failed one changes nothing:
        adapters.py)."""
        changed = False
        while not self._commands.empty():
            fn, done, box = self._commands.get()
            try:
                fn()  # under no lock: readers of adapters() and metrics must not wait for a load
                changed = True
            except Exception as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            self._counters.publish()
            done.set()
        return changed

    def _waiting_adapters(self) -> set:
        with self._wake:
            return {h.request.adapter for h in self._waiting}

    def _reload(self, name: str | None) -> bool:
        """Load the evicted adapter ``name`` that the first waiting request needs (``scheduler.pick`` saw
        room for it; its files read: ``_serve``); True if it was loaded. If that fails, the requests
        waiting for it end with "error" (it stays served: a later request tries again)."""
        if name is None or name not in self._pool or self._pool.loaded(name):  # unloaded meanwhile
            return False
        try:
            self._pool.reload(name)
            self._pool.fit(name, set(self._rows.adapters()), self._waiting_adapters(), idle=False)
        except Exception as e:  # noqa: BLE001 - only the requests for this adapter are involved
            logger.exception("hf_invisiblelora engine: loading adapter %r again failed", name)
            with self._wake:
                failed = [h for h in self._waiting if h.request.adapter == name]
                for h in failed:
                    self._waiting.remove(h)
                    h._finish("error", f"loading adapter {name!r} failed: {type(e).__name__}: {e}")
            self._counters.add(failed_requests=len(failed))
            return self._pool.loaded(name)
        finally:
            self._counters.publish()
        return True
