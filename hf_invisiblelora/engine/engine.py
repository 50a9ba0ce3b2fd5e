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

Each cycle the engine admits waiting requests into free rows (in prefill groups whose prompts,
left-padded to the group's longest, leave every row room for its budget and the drafts), then
runs one decoder cycle (decoder.py: the gate's drafts, one verify pass over every active row,
acceptance) and hands each request its committed tokens. While rows decode, a joining group's
short prompt rides in the cycle's verify pass (a ragged pass: each row its own tokens, the linear
layers computing the real ones only; as vLLM's and SGLang's chunked prefill mixes prompt and decode
tokens in a step), so that its join costs no pass of its own, where the pass stays small enough for
that to pay (``FOLD_SLOTS``); otherwise in passes of its own. A prompt of more than
``prefill_chunk`` tokens goes in chunks of at most that many, one chunk a cycle (each folded or not
by the same rule), so that rows that decode never wait for a whole long prompt. The group's rows
decode from the cycle after their last chunk. With no row decoding (or for requests that want
their prompt's log-probabilities), a group is prefilled in passes of its own. A
request's output does not depend on what else shares the batch: greedy output equals standalone
``generate()`` of its prompt with its adapter, and sampling with a seed gives the same tokens
whatever the batch (policies.RequestPolicy). An unexpected exception in a prefill, a cycle or a
delivery ends only the requests in it (finish reason "error"; logged, and counted in ``metrics``:
``failed_cycles``, ``failed_requests``); their rows are freed and the engine serves on.

Adapters can be loaded and unloaded while serving (between cycles; unloading one that a request
uses is refused). The engine holds the model's InvisibleLoRA lock while it runs: other
``generate(invisible_lora=True)`` calls on the model wait until it stops.

What it holds is bounded, as vLLM and SGLang bound it: ``max_loras`` distinct adapters in one pass
(a request whose adapter would be one too many waits; admission stays first come, first served:
scheduling.py) and ``max_cpu_loras`` adapters loaded in the model (the least recently used idle one
is evicted and loaded again when a request names it: adapters.py), by default ``max_loras`` (else
``max_batch``) or what the model holds at start, and one more.

A command (load, reload, unload) either takes effect or changes nothing: adapters.py makes its one
model operation first and its records after. An adapter's folder is read on the caller's thread
(an evicted one's on adapters.py's reader thread), never on the engine's, so no file stalls serving.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading

import torch

from ..decode.checks import check_adapter_state, check_model, check_options
from ..decode.decoder import Decoder
from ..decode.drafters import check_dtype as check_draft_dtype, fixed_vocabulary, make_drafters
from ..decode.policies import RequestPolicy
from ..decode.session import Session, lora_backend
from ..lora.files import MAX_RANK
from ..model.layout import prompt_positions
from ..model.prepack import available_bytes, check_mode as check_prepack
from ..model.rotary import length_dependent
from ..model.state import state_of
from ..model.walk import BASE
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
from .prefix_cache import BLOCK, PrefixCaching
from .resolver import AdapterResolver
from .request import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, Handle, InvalidRequest, PromptTooLong, Request, Status, validate
from .rows import Rows
from .scheduling import left_padded, pick, prefill_groups

logger = logging.getLogger("hf_invisiblelora")
__all__ = ["Engine", "PREFILL_CHUNK", "Request", "Handle", "Status", "MAX_LOGPROBS", "MAX_STOP_TOKEN_IDS",
           "InvalidRequest", "PromptTooLong", "QueueFull", "NotRunning", "UnknownAdapter", "AdapterBusy", "LastAdapter",
           "AdapterExists", "AdapterUnsupported"]


PREFILL_CHUNK = 512  # Engine(prefill_chunk=): prompt tokens per prefill pass (--prefill-chunk)
# Engine(prefix_cache_bytes=) by default: 1 GiB, at most a quarter of the memory available at start.
PREFIX_CACHE_BYTES = 1 << 30
# The most query positions (rows of the pass x the chunk's width) of a verify pass that a joining
# prompt's chunk rides in: the pass is rectangular outside the linear layers (its norms, activations
# and attention run every row over the chunk's width), which costs more than the pass of its own it
# saves once the rectangle is large. Measured on SmolLM2 on a 2-core CPU (benchmarks/bench_fold.py;
# docs/benchmarks.md, "One pass per engine cycle"): 8 rows x 4-16 slots, 4 x 16 and 2 x 8-32 folded
# 1-29% cheaper than a cycle plus a prefill of its own, 8 x 48 40% dearer. A larger chunk takes a
# pass of its own.
FOLD_SLOTS = 128


class QueueFull(RuntimeError):
    """The engine's queue holds ``max_queue`` requests already."""


class NotRunning(RuntimeError):
    """The engine is not running (not started, stopped, or failed)."""


def _bound(name: str, value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}.")
    return value


class Engine:
    """A fixed number of rows (``max_batch``) over one shared cache of ``max_len`` slots per row
    (prompt + new tokens + drafts). See the module docstring."""

    def __init__(self, model, max_batch: int = 8, max_len: int = 1024, num_draft_tokens: int = 4,
                 gate: str = "auto", max_queue: int = 1024, max_loras: int | None = None,
                 max_cpu_loras: int | None = None, adapter_paths: dict | None = None, draft_vocab=None,
                 draft_dtype="auto", prompt_lookup: bool = True, prepack="auto",
                 prefill_chunk: int | None = PREFILL_CHUNK,
                 max_lora_rank: int = MAX_RANK, prefix_caching: bool = True, prefix_cache_bytes: int | None = None,
                 lora_resolver_dirs=()):
        """``max_loras``, ``max_cpu_loras``: the bounds of the module docstring (``max_loras`` None: none;
        ``max_cpu_loras`` None: the default there).
        ``adapter_paths``: {name: local PEFT adapter folder}, for adapters the model has loaded (so
        that they can be evicted and loaded again) and for others, loaded when a request names them.
        ``draft_vocab``, ``draft_dtype``, ``prompt_lookup``: the drafters' options, as generate() takes them (an int
        vocabulary: the most frequent tokens earlier generate(invisible_lora=True) calls on the
        model have seen). ``prepack``: the linear layers on prepacked weight copies, as generate() takes it
        (prepack.py: checked or made when the engine's thread starts). ``prefill_chunk``: the most
        prompt tokens one pass takes (rows x tokens; None: every prompt in one): longer prompts are
        prefilled in chunks, one a cycle (the module docstring).
        ``max_lora_rank``: the largest rank an adapter loaded while serving may have (vLLM's
        ``max_lora_rank``), checked before anything is allocated for it (files.py).
        ``prefix_caching``: keep the keys and values of prompts' blocks and prefill a later prompt that
        starts the same, under the same weights, from where they end (prefix_cache.py; vLLM's automatic
        prefix caching), in at most ``prefix_cache_bytes`` (default PREFIX_CACHE_BYTES, at most a
        quarter of the memory available); off by itself for models whose keys and values a prefix
        cannot give exactly (windowed cache layers: logged at start).
        ``lora_resolver_dirs``: folders where an adapter a request names and the engine does not
        serve is looked up (resolver.py: ``<dir>/<name>``, or a Hugging Face Hub cache's snapshot of
        ``org/repo``) and loaded, read inside the folder it was found in (``resolve``)."""
        check_model(model)
        check_options(gate, num_draft_tokens, "bank", False, draft_vocab, prompt_lookup)  # generate()'s own checks of these
        check_prepack(prepack)
        check_adapter_state(model, [], mixed=True)  # no dropout in training mode anywhere
        inner = model.get_base_model()
        if any(length_dependent(m) for m in inner.modules()):
            raise ValueError("The serving engine does not support rotary embeddings that depend on the sequence "
                             "length (dynamic NTK, LongRoPE): their frequencies follow the batch's longest row.")
        self.model, self.inner = model, inner
        self.max_batch, self.max_len, self.num_draft_tokens, self.gate_mode = max_batch, max_len, num_draft_tokens, gate
        self.max_queue = max_queue
        self.vocab_size = inner.get_input_embeddings().weight.shape[0]  # also under a LoRA or modules_to_save wrapper
        self.state = state_of(model)
        self.draft_vocab = fixed_vocabulary(draft_vocab, self.state, inner, self.vocab_size)  # (ids or None, size)
        self.draft_dtypes = check_draft_dtype(draft_dtype, model)
        self.prompt_lookup = prompt_lookup
        self.prepack = prepack
        self.error = None  # what stopped the engine's thread, if it failed
        limit = getattr(inner.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.max_positions = limit
        eos = inner.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = eos  # a request's stop ids: these (unless ignore_eos) and its stop_token_ids
        self.pad_id = inner.generation_config.pad_token_id or (eos[0] if eos else 0)
        self._waiting = collections.deque()
        self._commands = queue.Queue()
        self._wake = threading.Condition()
        self._cancelled = set()
        self._thread = None
        self._decoder = None  # the engine thread's Decoder while it runs (read by tests)
        self._running = False
        self._state_lock = threading.Lock()  # metrics and adapter changes: read from other threads
        self.max_loras, self.max_cpu_loras = _bound("max_loras", max_loras), _bound("max_cpu_loras", max_cpu_loras)
        self.prefill_chunk = _bound("prefill_chunk", prefill_chunk)
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}.")
        self.prefix_caching, self.prefix_cache_bytes = prefix_caching, _bound("prefix_cache_bytes", prefix_cache_bytes)
        self._prefix = None  # prefix_cache.PrefixCaching while the engine's thread runs (None: off)
        self._chunked = collections.deque()  # [group, slots done]: prompts being prefilled in chunks
        self._retiring = set()  # keys of old revisions whose deletion is queued (_retire)
        self.resolver = AdapterResolver(lora_resolver_dirs) if lora_resolver_dirs else None
        if self.max_cpu_loras is None:  # vLLM's default is max_loras; room for what the model holds, and one more
            self.max_cpu_loras = max(self.max_loras or max_batch, len(model.peft_config) + 1)
        # Changed on the engine's thread under _wake; submit() reads it under the same lock.
        self._pool = AdapterManager(model, self.max_cpu_loras, adapter_paths, _bound("max_lora_rank", max_lora_rank))
        self._adapters = self._pool.paths()  # what other threads read (adapters(), adapter_paths())
        self._nudges = 0  # submissions and cancels so far: an engine waiting for an adapter's files looks again
        self._policy = RequestPolicy(max_batch, inner.device)
        self._rows = Rows(max_batch, self._policy, self._pool, self._count, self.max_len - num_draft_tokens - 1,
                          ended=self._ended)
        self.metrics = dict(cycles=0, tokens=0, k_hist=collections.Counter(),
                            drafted=collections.Counter(), accepted=collections.Counter(), requests=0,
                            failed_cycles=0, failed_requests=0, loaded_adapters=len(model.peft_config))

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
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}); retry later.")
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
        return min(self.max_len - self.num_draft_tokens - 1, self.max_positions or self.max_len)

    def stop_ids(self, ignore_eos: bool, stop_token_ids) -> list[int]:
        """The token ids that end a request: the model's EOS ids (unless ignore_eos) and its stop_token_ids."""
        return list(dict.fromkeys(([] if ignore_eos else self.eos_ids) + list(stop_token_ids)))

    def adapters(self) -> list[str]:
        """Every adapter the engine serves, loaded or evicted (loaded again when a request names it)."""
        with self._state_lock:
            return list(self._adapters)

    def adapter_paths(self) -> dict:
        """{adapter served: the folder its current revision was read from, or None (made in-process)}."""
        with self._state_lock:
            return dict(self._adapters)

    def metrics_snapshot(self) -> dict:
        """A copy of ``metrics`` (the engine's thread updates it every cycle), with the adapter
        pool's ``loads`` and ``evictions`` and the prefix cache's prompt tokens looked up and found
        (``prefix_queries``, ``prefix_hits``), blocks and bytes kept."""
        p = self._prefix
        with self._state_lock:
            return {**{k: dict(v) if isinstance(v, dict) else v for k, v in self.metrics.items()},
                    "loads": self._pool.loads, "evictions": self._pool.evictions,
                    "prefix_queries": p.queries if p else 0, "prefix_hits": p.hits if p else 0,
                    "prefix_blocks": len(p.cache) if p else 0, "prefix_bytes": p.cache.bytes if p else 0}

    def _count(self, **added) -> None:
        with self._state_lock:
            for name, n in added.items():
                self.metrics[name] += n

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
        """Load a PEFT adapter between cycles (adapters.py: its folder read here, on the caller's
        thread, inside ``roots``, the real paths its files may be read under, None: anywhere; its name
        checked, check_name). One the engine cannot read or serve is refused with AdapterUnsupported
        (a ValueError) or the files' errors; either way nothing changed. Past ``max_cpu_loras`` the
        least recently used idle adapter is evicted; if every other one is in use, this one is (it
        stays served, loaded when a request names it).

        ``inplace`` (vLLM's ``load_inplace``): a name already served gets the new weights as a new
        revision, without an unload. Requests admitted from then on decode with it; requests already
        in a row finish on the revision they started with (AdapterRef: adapters.py); ``Handle.revision``
        says which. The prefix cache never gives one revision's blocks to another (prefix_cache.py:
        roots by contents)."""
        self._load(name, path, roots, inplace, resolved=False, timeout=timeout)

    def _load(self, name: str, path, roots, inplace: bool, resolved: bool, timeout: float = 600) -> None:
        check_name(name)
        path = os.fspath(path)
        if not self.alive:
            raise NotRunning("The engine is not running.")
        files = self._pool.read(path, roots)  # here: a folder never stalls the engine's thread

        def load():
            if name == BASE or name in self._pool and not inplace:
                raise AdapterExists(f"An adapter named {name!r} is already served (or reserved).")
            if name in self._pool:
                self._pool.replace(name, files, path, roots, held=self._pool.ref(name).key in self._decoder.names)
            else:
                self._pool.add(name, files, path, roots, resolved)
            self._fit(name, idle=True)
        self._command(load, timeout)

    def _retire(self, decoder: Decoder) -> None:
        """Old revisions (reloads in place) that no row decodes with any more are deleted: queued as a
        command (a model change, between cycles)."""
        done = [key for key in self._pool.retired if key not in decoder.names and key not in self._retiring]
        for key in done:
            self._retiring.add(key)

            def retire(key=key):
                self._retiring.discard(key)
                self._pool.retire(key)
            self._commands.put((retire, threading.Event(), {}))

    def unload_adapter(self, name: str, timeout: float = 600) -> None:
        """Unload an adapter between cycles (an evicted one too: the engine forgets it); refused while
        a request uses it, and for the last one loaded."""
        def unload():
            with self._wake:  # submit() checks the adapter and queues a request under the same lock
                if name not in self._pool:
                    raise UnknownAdapter(f"No adapter named {name!r} is served; served: {self._pool.names()}.")
                if self._pool.loaded(name) and len(self.model.peft_config) == 1:
                    raise LastAdapter(f"{name!r} is the last adapter loaded; a PEFT model keeps at least one.")
                busy = [a for a in [h.request.adapter for h in self._waiting] + self._rows.adapters() if a == name]
                if busy:
                    raise AdapterBusy(f"Adapter {name!r} is in use by {len(busy)} request(s); unload it when they "
                                       "are done.")
                self._pool.forget(name)
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
        with self._wake:
            for h in list(self._waiting) + [h for _, h in self._rows.taken()]:
                h._finish("cancelled")
            self._waiting.clear()
        self._fail_commands(NotRunning("The engine stopped before running the command."))
        if self._thread is None or not self._thread.is_alive():  # no row decodes: the model keeps no old revision
            for old in list(self._pool.retired):
                self._pool.retire(old)
            self._pool.close()

    def _fail_commands(self, error: Exception) -> None:
        while not self._commands.empty():
            _, done, box = self._commands.get()
            box["error"] = error
            done.set()

    # --- the engine's thread ---

    def _session(self) -> Session:
        """The decoder's assembly (session.py): every row its own request (RequestPolicy) and adapter."""
        drafters = make_drafters(self.model, self.state, self.draft_dtypes, *self.draft_vocab,
                                 prompt_lookup=self.prompt_lookup, drafting=self.gate_mode != "never")
        return Session(self.model, self.state, self._policy, capacity=self.max_batch, width=self.max_len, mixed=True,
                       lora_backend=lora_backend(self.model, self.model.peft_config), gate=self.gate_mode,
                       num_draft_tokens=self.num_draft_tokens, drafters=drafters, prepack=self.prepack,
                       pad_id=self.pad_id, history=False, together=False,
                       eos=torch.full((self.max_batch, max(len(self.eos_ids), 1)), -1, device=self.inner.device))

    def _run(self) -> None:
        try:
            with self.state.hold(), torch.no_grad():
                session = self._session()
                self._decoder = session.decoder
                self._prefix = self._prefix_caching(session)
                while self._running:
                    with session.installed() as decoder:
                        needed = self._serve(decoder)
                    if self._run_commands() | self._reload(needed):
                        session.renew_lora(self.model, lora_backend(self.model, self.model.peft_config))
                        if self._prefix is not None:
                            self._prefix.renew(session.check)
                        return_freed_memory()
        except Exception as e:  # noqa: BLE001 - every request learns the engine failed
            logger.exception("hf_invisiblelora engine failed")
            self.error = f"{type(e).__name__}: {e}"
            with self._wake:
                self._running = False
                for h in list(self._waiting) + [h for _, h in self._rows.taken()]:
                    h._finish("error", self.error)
                self._waiting.clear()
            self._fail_commands(NotRunning(f"The engine failed: {self.error}"))

    def _serve(self, decoder: Decoder) -> str | None:
        """Cycles until a command (an adapter change) arrives, the engine stops, or the first
        waiting request needs an evicted adapter loaded and its files are read (its name is
        returned; until they are, the rows decode on, or the engine waits)."""
        while True:
            with self._wake:
                while self._running and self._commands.empty() and not self._waiting and not self.running():
                    self._wake.wait()
            if not self._commands.empty() or not self._running:
                return None
            with self._wake:
                cancelled, self._cancelled, nudges = self._cancelled, set(), self._nudges
            self._rows.drop(decoder, cancelled)
            needed = self._admit(decoder)
            if needed is not None:
                if self._pool.prefetch(needed, self._notify).done():
                    return needed
            # The next chunk of prompt slots rides in the cycle's verify pass; alone if no row decodes.
            joining = self._next_chunk(decoder, fold=bool(decoder.batch.active)) if self._chunked else None
            if decoder.batch.active:
                self._cycle(decoder, joining)
            elif needed is not None and not self._chunked:  # nothing to do but wait for its files
                with self._wake:
                    while self._running and self._commands.empty() and self._nudges == nudges and \
                            not self._pool.prefetch(needed, self._notify).done():
                        self._wake.wait()
            if self._pool.retired:
                self._retire(decoder)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _cycle(self, decoder: Decoder, joining=None) -> None:
        """One decoder cycle over the active rows, then delivery; ``joining`` ((group, start, end) of
        ``_next_chunk``): a chunk of a group's prompt slots in its verify pass. If it raises, the
        requests in it end with "error" and the engine serves on (``Rows.fail``)."""
        try:
            before = list(zip(decoder.drafted, decoder.accepted))
            committed = decoder.cycle(None if joining is None else ([r for r, _ in joining[0]], *joining[1:]))
            with self._state_lock:
                m = self.metrics
                m["cycles"] += 1
                m["k_hist"][decoder.k] += 1
                for r, h in self._rows.taken():  # drafted / accepted per adapter, as they happen
                    m["drafted"][h.request.adapter] += decoder.drafted[r] - before[r][0]
                    m["accepted"][h.request.adapter] += decoder.accepted[r] - before[r][1]
        except Exception as e:  # noqa: BLE001 - every row of the cycle is involved; the engine serves on
            # Rows waiting for their prompt's chunks were not in it (but the joining group, whose chunk
            # was): a cycle writes their slots only from their last prompt slot on, which their last
            # chunk writes again.
            group = joining[0] if joining is not None else []
            if joining is not None:
                self._chunked.popleft()
            self._rows.fail(decoder, [(r, h) for r, h in self._rows.taken()
                                      if not decoder.waiting[r] or (r, h) in group], "decoding", e)
            return
        if joining is not None:
            group, _, end = joining
            self._chunked[0][1] = end
            if not decoder.waiting[group[0][0]]:  # its prompts are in: their first tokens too
                self._chunked.popleft()
                self._prefilled(decoder, group, committed)
                return
        self._rows.deliver(decoder, committed)

    def _run_commands(self) -> bool:
        """Run the queued adapter changes; True if one took effect (a refused or failed one changes nothing:
        adapters.py)."""
        changed = False
        while not self._commands.empty():
            fn, done, box = self._commands.get()
            try:
                fn()  # not under _state_lock: readers of adapters() and metrics must not wait for a load
                changed = True
            except Exception as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            self._publish_adapters()
            done.set()
        return changed

    def _publish_adapters(self) -> None:
        with self._state_lock:
            self._adapters = self._pool.paths()
            self.metrics["loaded_adapters"] = len(self.model.peft_config)

    # --- bounded adapters (the engine's thread; the pool is adapters.py) ---

    def _fit(self, loaded: str, idle: bool) -> None:
        """After loading ``loaded``: evict one adapter if that makes one more than max_cpu_loras (AdapterManager.fit)."""
        self._pool.fit(loaded, set(self._rows.adapters()),
                       {h.request.adapter for h in self._waiting}, idle)

    def _reload(self, name: str | None) -> bool:
        """Load the evicted adapter ``name`` that the first waiting request needs (``scheduling.pick`` saw
        room for it; its files read: ``_serve``); True if it was loaded. If that fails, the requests
        waiting for it end with "error" (it stays served: a later request tries again)."""
        if name is None or name not in self._pool or self._pool.loaded(name):  # unloaded meanwhile
            return False
        try:
            self._pool.reload(name)
            self._fit(name, idle=False)
        except Exception as e:  # noqa: BLE001 - only the requests for this adapter are involved
            logger.exception("hf_invisiblelora engine: loading adapter %r again failed", name)
            with self._wake:
                failed = [h for h in self._waiting if h.request.adapter == name]
                for h in failed:
                    self._waiting.remove(h)
                    h._finish("error", f"loading adapter {name!r} failed: {type(e).__name__}: {e}")
            self._count(failed_requests=len(failed))
            return self._pool.loaded(name)
        finally:
            self._publish_adapters()
        return True

    def _admit(self, decoder: Decoder) -> str | None:
        """Waiting requests take the free rows (scheduling.pick), in prefill groups that fit; returns the
        evicted adapter to load before the first waiting request can join, or None."""
        free = self._rows.free()
        if not free:
            return None
        with self._wake:
            picked, needed = pick(self._waiting, self._rows.most_left(decoder), len(free), self.max_loras, self._pool)
            for h in picked:
                self._waiting.remove(h)
                h.ref = self._pool.ref(h.request.adapter)  # the revision it decodes with, whatever comes after
        joining = list(zip(free, picked))
        if not joining:
            return needed
        try:
            cached, joining = ([], joining) if self._prefix is None else self._prefix.lookup(joining)
            groups = prefill_groups(joining, self.max_len - self.num_draft_tokens - 1)
        except Exception as e:  # noqa: BLE001 - the joining requests are involved
            self._rows.fail(decoder, joining, "admission", e)
            return needed
        for pair, blocks in cached:  # each alone: its prompt's slots start where its cached blocks do
            self._prefill(decoder, [pair], blocks)
        for group in groups:
            self._prefill(decoder, group)
        return needed

    def _prefill(self, decoder: Decoder, group: list, blocks=()) -> None:
        """A group's prefill (Decoder.admit): in one pass, then delivery of their first tokens; or, when
        its prompt tokens are more than ``prefill_chunk``, its rows loaded and queued for their chunks
        (``_next_chunk``). ``blocks``: a group of one whose prompt starts with these cached blocks
        (``PrefixCaching.lookup``), written into its slots and not prefilled. If it raises, the group's
        requests end with "error" and the engine serves on (``Rows.fail``)."""
        self._rows.take(group)
        cached = len(blocks) * BLOCK
        try:
            ids, mask = left_padded([h.request.prompt for _, h in group], self.pad_id, self.inner.device)
            width = ids.shape[1] - cached
            for r, h in group:
                stops = self.stop_ids(h.request.ignore_eos, h.request.stop_token_ids)
                decoder.set_stops(r, stops)
                self._policy.set_request(r, h.request, stops)
                if self._prefix is not None:
                    self._prefix.admitted(r)
            # While rows decode, a short prompt rides in a cycle's verify pass (_next_chunk), as the chunks do.
            folded = self._folds(decoder, group, width)
            chunked = decoder.chunkable and (folded or self.prefill_chunk is not None and len(group) * width > self.prefill_chunk)
            if blocks:
                decoder.fwd.cache.write(group[0][0], 0, blocks)
            # max_tokens 0 (the prompt's log-probabilities only): decoded as 1, nothing delivered (Rows.deliver)
            committed = decoder.admit([r for r, _ in group], ids, mask, prompt_positions(mask, ids),
                                 [max(h.request.max_tokens, 1) for _, h in group],
                                 [h.ref.key for _, h in group], upto=0 if chunked else None, cached=cached)
        except Exception as e:  # noqa: BLE001 - only the group is involved; the rows decoding go on
            self._rows.fail(decoder, group, "prefill", e)
            return
        if committed is None:
            self._chunked.append([group, cached])
            return
        self._prefilled(decoder, group, committed)

    def _prefilled(self, decoder: Decoder, group: list, committed: list[int]) -> None:
        """A group's prompts are in the cache: their blocks are kept (prefix caching), their first
        tokens delivered."""
        for r, h in group:
            self._keep_blocks(decoder, r, h, 0)
        self._rows.prefilled(decoder, group, committed)

    def _ended(self, decoder: Decoder, r: int, h) -> None:
        """Row r's request ends (Rows.release, before its row is freed): the blocks of its prompt and
        output are kept (prefix caching) if it decoded."""
        if self._prefix is not None:
            if h.status == Status.DECODING and h.finish_reason is None:
                self._keep_blocks(decoder, r, h, decoder.generated(r) - 1)
            self._prefix.released(r)

    def _keep_blocks(self, decoder: Decoder, r: int, h, output: int) -> None:
        """Keep the blocks of row r's prompt and its first ``output`` generated tokens (a failure here is
        logged and costs only the blocks)."""
        if self._prefix is None:
            return
        try:
            width = decoder.batch.plen_h[r]  # the prompt's slots end where its group's (left-padded) width does
            tokens = h.request.prompt + (decoder.batch.tokens[r, width : width + output].tolist() if output > 0 else [])
            self._prefix.keep(decoder.fwd.cache, r, h.ref.key, tokens, width - len(h.request.prompt))
        except Exception:  # noqa: BLE001 - the blocks are an optimization; the requests go on
            logger.exception("hf_invisiblelora engine: keeping prompt blocks failed")

    def _prefix_caching(self, session: Session) -> PrefixCaching | None:
        """The engine's prefix caching, or None: off, or a model whose keys and values a cached prefix
        cannot give exactly (said at start)."""
        if not self.prefix_caching:
            return None
        if not session.decoder.chunkable:
            logger.warning("hf_invisiblelora engine: prefix caching is off: the model has windowed cache layers "
                           "(sliding-window attention), whose prompts are prefilled whole.")
            return None
        size = self.prefix_cache_bytes
        if size is None:
            room = available_bytes()
            size = PREFIX_CACHE_BYTES if room is None else min(PREFIX_CACHE_BYTES, room // 4)
        logger.info("hf_invisiblelora engine: prefix caching on, in at most %d MB", size >> 20)
        return PrefixCaching(self.model, size, session.check)

    def _folds(self, decoder: Decoder, group: list, width: int) -> bool:
        """Whether a chunk of ``width`` prompt slots of ``group`` rides in the next cycle's verify pass:
        rows decode, the pass (rows 0 .. the last of the group's or the decoding ones) times the width
        is within FOLD_SLOTS, and the requests want no prompt log-probabilities (which a pass of their
        own computes)."""
        rows = [r for r, _ in group]
        span = max(decoder.batch.hi, max(rows) + 1)
        return bool(decoder.batch.active) and span * width <= FOLD_SLOTS and not self._policy.wants_prompt(rows)

    def _next_chunk(self, decoder: Decoder, fold: bool):
        """The next chunk of the oldest group being prefilled in chunks (its requests still in their
        rows: cancelled ones are gone): (group, start, end) for the cycle's verify pass if ``fold``
        and it fits there (``_folds``), else run in a pass of its own, None returned; its last chunk
        delivers the rows' first tokens."""
        entry = self._chunked[0]
        group, done = entry
        group = entry[0] = [(r, h) for r, h in group if self._rows.handles[r] is h]
        if not group:
            self._chunked.popleft()
            return None
        budget = self.prefill_chunk or decoder.batch.plen_h[group[0][0]] * len(group)
        end = min(done + max(budget // len(group), 1), decoder.batch.plen_h[group[0][0]])
        if fold and self._folds(decoder, group, end - done):
            return group, done, end
        try:
            committed = decoder.prefill([r for r, _ in group], done, end)
        except Exception as e:  # noqa: BLE001 - only the group is involved
            self._chunked.popleft()
            self._rows.fail(decoder, group, "prefill", e)
            return None
        entry[1] = end
        if committed is not None:
            self._chunked.popleft()
            self._prefilled(decoder, group, committed)
        return None
