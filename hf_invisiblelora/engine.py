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

Each cycle the engine admits waiting requests into free rows (a prefill of those rows: one per
group of them whose prompts, left-padded to the group's longest, leave every row room for its
budget and the drafts), then runs one decoder cycle (decoding.py: the gate's drafts, one verify
pass over every active row, acceptance) and hands each request its committed tokens. A
request's output does not depend on what else shares the batch: greedy output equals standalone
``generate()`` of its prompt with its adapter, and sampling with a seed gives the same tokens
whatever the batch (policies.RequestPolicy). An unexpected exception in a prefill, a cycle or a
delivery ends only the requests in it (finish reason "error"; logged, and counted in ``metrics``:
``failed_cycles``, ``failed_requests``); their rows are freed and the engine serves on.

Adapters can be loaded and unloaded while serving (between cycles; unloading one that a request
uses is refused). The engine holds the model's InvisibleLoRA lock while it runs: other
``generate(invisible_lora=True)`` calls on the model wait until it stops.

What it holds can be bounded, as vLLM and SGLang do. ``max_loras``: distinct adapters in one pass
(the base model is none); a request whose adapter would be one too many waits. ``max_cpu_loras``:
adapters loaded in the model. The engine keeps the path of every adapter it serves (``load_adapter``,
and ``adapter_paths`` for those given at construction, loaded or not): when a load would go past the
bound it evicts the least recently used adapter that no request decodes with or waits for (for the
load a waiting request needs, one that only requests after it wait for, if there is no other), and
an evicted adapter is loaded again, between cycles, when a request names it. Admission stays first come,
first served: the first request that must wait for a slot or a load is not overtaken for one, and the
adapter in the batch that will be done first takes no new rows meanwhile, so it gets one within that
adapter's budgets (``_pick``). A swap loads the new adapter before it evicts the old one (a failed load
changes nothing, and PEFT keeps at least one adapter), so the model holds one adapter more for a moment.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import os
import queue
import threading
from dataclasses import dataclass, field

import torch

from .adapters import SWITCHES, bank_inexact
from .checks import BASE, check_adapter_state, check_model
from .decoding import Decoder
from .forward import EagerForward
from .gate import Gate
from .policies import RequestPolicy
from .rotary import length_dependent
from .state import state_of

logger = logging.getLogger("hf_invisiblelora")
_ids = itertools.count()
MAX_LOGPROBS = 20  # the most likely tokens a request may ask for with each token (vLLM's default max_logprobs)
MAX_STOP_TOKEN_IDS = 256
# Request fields validate() normalizes: int, float, an optional int (int?) or token ids.
_FIELD_TYPES = {"temperature": "float", "top_p": "float", "min_p": "float", "repetition_penalty": "float",
                "max_tokens": "int", "top_k": "int", "min_tokens": "int", "seed": "int?", "logprobs": "int?",
                "stop_token_ids": "ids"}


def _release_openmp_threads() -> None:
    """Free the calling thread's OpenMP worker threads (they come back when it next runs a parallel op).

    Every thread that runs torch ops has its own OpenMP team. Once the teams hold more threads than
    there are CPUs, libgomp stops spinning between parallel regions and each region waits for a
    futex wake-up: the engine's thread decoded about 45% slower (2 CPUs, SmolLM2) when the thread
    that loaded the model kept its team. Other threads running torch's parallel ops while the
    engine serves slow it down the same way."""
    try:
        ctypes.CDLL(None).omp_pause_resource_all(1)  # omp_pause_soft; OpenMP 5.0 (libgomp, libomp)
    except (AttributeError, OSError, TypeError):  # no OpenMP runtime in the global namespace
        pass


def _return_freed_memory() -> None:
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


class QueueFull(RuntimeError):
    """The engine's queue holds ``max_queue`` requests already."""


class NotRunning(RuntimeError):
    """The engine is not running (not started, stopped, or failed)."""


class UnknownAdapter(ValueError):
    """No adapter of that name is loaded."""


class InvalidRequest(ValueError):
    """What is wrong with a request; ``param``: the Request field it is about."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt plus max_tokens is longer than the engine's rows allow."""


class AdapterBusy(RuntimeError):
    """The adapter cannot be unloaded now: requests use it."""


class LastAdapter(AdapterBusy):
    """The adapter cannot be unloaded: a PEFT model keeps at least one."""


class AdapterExists(ValueError):
    """An adapter of that name is served already (or the name is reserved)."""


class AdapterUnsupported(ValueError):
    """The adapter loaded, but the engine cannot serve it (checks.check_model says why); it was removed."""


def _integer(value) -> int:
    if isinstance(value, bool) or not float(value).is_integer():
        raise ValueError(value)
    return int(value)


def _bound(name: str, value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}.")
    return value


@dataclass
class Request:
    """One completion: prompt token ids, adapter ("__base__": none) and sampling settings
    (temperature 0: greedy; top_k 0: no limit; min_p 0: none), as generate() and vLLM take them:
    ``repetition_penalty`` over the prompt and the output, ``min_tokens`` before a stop token may
    come, ``stop_token_ids`` ending the request besides the model's EOS ids (``ignore_eos``: not
    those). ``logprobs``: None, or how many of the most likely tokens to return with each token's
    raw log-probability (``Handle.logprobs``). ``on_tokens(tokens)``, if given, is called (on the
    engine's thread) with each chunk of committed tokens; returning True stops the request there
    (stop strings)."""

    prompt: list
    adapter: str = BASE
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None
    on_tokens: object = None
    id: int = field(default_factory=lambda: next(_ids))


class Handle:
    """A submitted request: iterate to get its committed token chunks; ``cancel()`` frees its row
    at the next cycle. ``finish_reason``: "stop", "length", "cancelled" or "error" once finished
    (``error`` then says why: its on_tokens callback raised, or the engine failed in a step it was in).
    ``logprobs`` (a request that asked): per token so far, (log-probability, [(token id,
    log-probability)] of the most likely), filled before its chunk is handed over."""

    def __init__(self, request: Request, engine: "Engine"):
        self.request, self.engine = request, engine
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.finish_reason = None
        self.error = None
        self.drafted = self.accepted = 0
        self._chunks = queue.Queue()
        self.done = threading.Event()

    def cancel(self) -> None:
        self.engine._cancel(self)

    def _put(self, tokens: list[int], logprobs=()) -> bool:
        """Hand over committed tokens; True if the request's on_tokens callback asks to stop."""
        self.tokens += tokens
        self.logprobs += logprobs
        self._chunks.put(tokens)
        return bool(self.request.on_tokens and self.request.on_tokens(tokens))

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self._chunks.put(None)
            self.done.set()

    def __iter__(self):
        while (chunk := self._chunks.get()) is not None:
            yield chunk

    def result(self, timeout: float | None = None) -> list[int]:
        """All generated tokens, once finished."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request.id} not finished after {timeout} s")
        return self.tokens


class Engine:
    """A fixed number of rows (``max_batch``) over one shared cache of ``max_len`` slots per row
    (prompt + new tokens + drafts). See the module docstring."""

    def __init__(self, model, max_batch: int = 8, max_len: int = 1024, num_draft_tokens: int = 4,
                 gate: str = "auto", max_queue: int = 1024, max_loras: int | None = None,
                 max_cpu_loras: int | None = None, adapter_paths: dict | None = None):
        """``max_loras``, ``max_cpu_loras``: the bounds of the module docstring (None: none).
        ``adapter_paths``: {name: local PEFT adapter folder}, for adapters the model has loaded (so
        that they can be evicted and loaded again) and for others, loaded when a request names them."""
        check_model(model)
        check_adapter_state(model, [], mixed=True)  # no dropout in training mode anywhere
        inner = model.get_base_model()
        if any(length_dependent(m) for m in inner.modules()):
            raise ValueError("The serving engine does not support rotary embeddings that depend on the sequence "
                             "length (dynamic NTK, LongRoPE): their frequencies follow the batch's longest row.")
        self.model, self.inner = model, inner
        self.max_batch, self.max_len, self.num_draft_tokens, self.gate_mode = max_batch, max_len, num_draft_tokens, gate
        self.max_queue = max_queue
        self.vocab_size = inner.get_input_embeddings().num_embeddings
        self.error = None  # what stopped the engine's thread, if it failed
        limit = getattr(inner.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.max_positions = limit
        self.state = state_of(model)
        eos = inner.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = eos  # a request's stop ids: these (unless ignore_eos) and its stop_token_ids
        self.pad_id = inner.generation_config.pad_token_id or (eos[0] if eos else 0)
        self._waiting = collections.deque()
        self._commands = queue.Queue()
        self._wake = threading.Condition()
        self._handles = [None] * max_batch  # the request in each row
        self._cancelled = set()
        self._thread = None
        self._decoder = None  # the engine thread's Decoder while it runs (read by tests)
        self._running = False
        self._state_lock = threading.Lock()  # metrics and adapter changes: read from other threads
        self.max_loras, self.max_cpu_loras = _bound("max_loras", max_loras), _bound("max_cpu_loras", max_cpu_loras)
        paths = {name: os.fspath(path) for name, path in (adapter_paths or {}).items()}
        if BASE in paths:
            raise ValueError(f"{BASE!r} is the base model, not an adapter name.")
        # Every adapter served, loaded or evicted -> its folder (None: unknown, so it is never evicted).
        # Changed on the engine's thread under _wake; submit() reads it under the same lock.
        self._paths = {**{name: None for name in model.peft_config}, **paths}
        if max_cpu_loras is not None:
            unknown = [name for name in model.peft_config if self._paths[name] is None]
            if len(model.peft_config) > max_cpu_loras:
                raise ValueError(f"The model has {len(model.peft_config)} adapters loaded, more than max_cpu_loras="
                                 f"{max_cpu_loras}; load fewer and give the others in adapter_paths.")
            if len(unknown) >= max_cpu_loras:
                raise ValueError(f"max_cpu_loras={max_cpu_loras} leaves no room to load an adapter besides {unknown}, "
                                 "whose paths the engine does not know (it cannot evict them); give them in "
                                 "adapter_paths.")
        self._ticks = itertools.count()
        self._used = {name: next(self._ticks) for name in self._paths}  # adapter -> when last used (LRU)
        self._adapters = list(self._paths)
        self.metrics = dict(cycles=0, tokens=0, k_hist=collections.Counter(),
                            drafted=collections.Counter(), accepted=collections.Counter(), requests=0,
                            failed_cycles=0, failed_requests=0, loads=0, evictions=0,
                            loaded_adapters=len(model.peft_config))

    # --- the client side (any thread) ---

    def submit(self, request: Request) -> Handle:
        """Queue a request; it joins a free row at the next cycle. Bad requests raise ValueError;
        a full queue raises QueueFull; an engine that is not running (or failed) raises RuntimeError."""
        self.validate(request)
        handle = Handle(request, self)
        with self._wake:
            if not self.alive:
                raise NotRunning(f"The engine is not running{f' (it failed: {self.error})' if self.error else ''}.")
            if request.adapter != BASE and request.adapter not in self._paths:  # unloaded meanwhile
                raise UnknownAdapter(f"Unknown adapter {request.adapter!r}; served: {list(self._paths)}.")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}); retry later.")
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    @property
    def alive(self) -> bool:
        """The engine's thread is serving."""
        return self._running and self._thread is not None and self._thread.is_alive()

    def validate(self, request: Request) -> None:
        """Raise InvalidRequest (a ValueError) naming the field that is wrong with ``request``;
        normalizes its numbers' types. The one validation of a request's values (the server checks
        only what its JSON may hold)."""
        def check(ok, param, message):
            if not ok:
                raise InvalidRequest(param, message)

        check(request.prompt, "prompt", "The prompt is empty.")
        check(all(isinstance(t, int) and 0 <= t < self.vocab_size for t in request.prompt), "prompt",
              f"The prompt must be token ids in [0, {self.vocab_size}).")
        for name, kind in _FIELD_TYPES.items():
            value = getattr(request, name)
            try:
                if kind == "ids":
                    value = [_integer(t) for t in value]
                elif value is not None or kind in ("int", "float"):
                    value = float(value) if kind.startswith("float") else _integer(value)
            except (TypeError, ValueError):
                what = {"ids": "a list of token ids", "float": "a number"}.get(kind.removesuffix("?"), "an integer")
                raise InvalidRequest(name, f"{name} must be {what}, got {value!r}.") from None
            setattr(request, name, value)
        check(isinstance(request.ignore_eos, bool), "ignore_eos", f"ignore_eos must be a boolean, got {request.ignore_eos!r}.")
        check(request.max_tokens >= 1, "max_tokens", f"max_tokens must be >= 1, got {request.max_tokens}.")
        check(request.temperature >= 0, "temperature", f"temperature must be >= 0, got {request.temperature}.")
        check(0 < request.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {request.top_p}.")
        check(request.top_k >= 0, "top_k", f"top_k must be >= 0, got {request.top_k}.")
        check(0 <= request.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {request.min_p}.")
        check(0 < request.repetition_penalty < float("inf"), "repetition_penalty",
              f"repetition_penalty must be > 0, got {request.repetition_penalty}.")
        check(request.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {request.min_tokens}.")
        check(request.logprobs is None or 0 <= request.logprobs <= MAX_LOGPROBS, "logprobs",
              f"logprobs must be in [0, {MAX_LOGPROBS}], got {request.logprobs}.")
        check(len(request.stop_token_ids) <= MAX_STOP_TOKEN_IDS and
              all(0 <= t < self.vocab_size for t in request.stop_token_ids), "stop_token_ids",
              f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids in [0, {self.vocab_size}).")
        check(request.seed is None or -(2**63) <= request.seed < 2**64, "seed",  # what torch's generators take
              f"seed must be in [-2**63, 2**64), got {request.seed}.")
        if request.adapter != BASE and request.adapter not in self._paths:
            raise UnknownAdapter(f"Unknown adapter {request.adapter!r}; served: {self.adapters()}.")
        if len(request.prompt) + request.max_tokens > self.max_request_tokens:
            raise PromptTooLong("prompt", f"The prompt ({len(request.prompt)} tokens) plus max_tokens "
                                f"({request.max_tokens}) is longer than this server allows ({self.max_request_tokens} "
                                "tokens); shorten the prompt or max_tokens.")

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + new tokens a request may have: a row's slots less the drafts' room, and
        the model's position limit."""
        return min(self.max_len - self.num_draft_tokens - 1, self.max_positions or self.max_len)

    def adapters(self) -> list[str]:
        """Every adapter the engine serves, loaded or evicted (loaded again when a request names it)."""
        with self._state_lock:
            return list(self._adapters)

    def metrics_snapshot(self) -> dict:
        """A copy of ``metrics`` (the engine's thread updates it every cycle)."""
        with self._state_lock:
            return {k: dict(v) if isinstance(v, dict) else v for k, v in self.metrics.items()}

    def queue_length(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return sum(h is not None for h in self._handles)

    def load_adapter(self, name: str, path: str, timeout: float = 600) -> None:
        """Load a PEFT adapter between cycles. One the engine cannot serve (checks.check_model) is
        refused with a ValueError and removed again, as is one PEFT fails to load. Past
        ``max_cpu_loras`` the least recently used idle adapter is evicted; if every other one is in
        use, this one is (it stays served, loaded when a request names it)."""
        def load():
            if name == BASE or name in self._paths:
                raise AdapterExists(f"An adapter named {name!r} is already served (or reserved).")
            self._load(name, os.fspath(path))
            with self._wake:
                self._paths[name] = os.fspath(path)
            self._fit(name, idle=True)
        self._command(load, timeout)

    def unload_adapter(self, name: str, timeout: float = 600) -> None:
        """Unload an adapter between cycles (an evicted one too: the engine forgets it); refused while
        a request uses it, and for the last one loaded."""
        def unload():
            with self._wake:  # submit() checks the adapter and queues a request under the same lock
                if name not in self._paths:
                    raise UnknownAdapter(f"No adapter named {name!r} is served; served: {list(self._paths)}.")
                loaded = name in self.model.peft_config
                if loaded and len(self.model.peft_config) == 1:
                    raise LastAdapter(f"{name!r} is the last adapter loaded; a PEFT model keeps at least one.")
                busy = [h for h in list(self._waiting) + self._handles if h is not None and h.request.adapter == name]
                if busy:
                    raise AdapterBusy(f"Adapter {name!r} is in use by {len(busy)} request(s); unload it when they "
                                       "are done.")
                if loaded:
                    self._delete(name)
                del self._paths[name], self._used[name]
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
            self._wake.notify()

    def start(self) -> "Engine":
        _release_openmp_threads()
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
            for h in list(self._waiting) + self._handles:
                if h is not None:
                    h._finish("cancelled")
            self._waiting.clear()
        self._fail_commands(NotRunning("The engine stopped before running the command."))

    def _fail_commands(self, error: Exception) -> None:
        while not self._commands.empty():
            _, done, box = self._commands.get()
            box["error"] = error
            done.set()

    # --- the engine's thread ---

    def _run(self) -> None:
        state, inner = self.state, self.inner
        with state.lock:
            state.owner = threading.get_ident()
            try:
                lora = self._switch()
                fwd = EagerForward(inner, lora, self.max_batch, self.max_len, inner.device)
                gate = Gate(self.gate_mode, self.num_draft_tokens, state.gate, BASE)
                decoder = Decoder(fwd, lora, RequestPolicy(self.max_batch, inner.device), gate,
                                  capacity=self.max_batch, pad_id=self.pad_id, history=False,
                                  eos=torch.full((self.max_batch, max(len(self.eos_ids), 1)), -1, device=inner.device))
                self._decoder = decoder
                while self._running:
                    needed = self._serve(decoder)
                    if self._run_commands() | self._reload(needed):
                        # An adapter change: a new bank (its slots may move); the rows in flight keep going.
                        decoder.lora = fwd.lora = lora = self._switch()
                        lora.set_rows(decoder.names)
                        fwd.set_rows(decoder.names)
                        _return_freed_memory()
            except Exception as e:  # noqa: BLE001 - every request learns the engine failed
                logger.exception("hf_invisiblelora engine failed")
                self.error = f"{type(e).__name__}: {e}"
                with self._wake:
                    self._running = False
                    for h in list(self._waiting) + self._handles:
                        if h is not None:
                            h._finish("error", self.error)
                    self._waiting.clear()
                self._fail_commands(NotRunning(f"The engine failed: {self.error}"))
            finally:
                state.owner = None

    def _switch(self):
        """The LoRA switch for the loaded adapters: the bank, or PEFT's own layers where the bank
        would not compute them as PEFT does (adapters.bank_inexact)."""
        why = bank_inexact(self.model, set(self.model.peft_config))
        if why:
            logger.info("hf_invisiblelora engine: PEFT's own LoRA layers compute the passes (%s).", why)
        return SWITCHES["peft" if why else "bank"](self.model, True, self.state.mine)

    def _serve(self, decoder: Decoder) -> str | None:
        """Cycles until a command (an adapter change) arrives, the engine stops, or the first
        waiting request needs an evicted adapter loaded (its name is returned)."""
        with decoder.lora.installed(), torch.no_grad():
            while True:
                with self._wake:
                    while self._running and self._commands.empty() and not self._waiting and not self.running():
                        self._wake.wait()
                if not self._commands.empty() or not self._running:
                    return None
                self._drop_cancelled(decoder)
                needed = self._admit(decoder)
                if needed is not None:
                    return needed
                if decoder.rows.active:
                    self._cycle(decoder)

    def _cycle(self, decoder: Decoder) -> None:
        """One decoder cycle over the active rows, then delivery. If it raises, the requests in it
        end with "error" and the engine serves on (``_fail``)."""
        try:
            before = list(zip(decoder.drafted, decoder.accepted))
            kept = decoder.cycle()
            with self._state_lock:
                m = self.metrics
                m["cycles"] += 1
                m["k_hist"][decoder.k] += 1
                for r, (d, a) in enumerate(before):  # drafted / accepted per adapter, as they happen
                    if self._handles[r] is not None:
                        m["drafted"][self._handles[r].request.adapter] += decoder.drafted[r] - d
                        m["accepted"][self._handles[r].request.adapter] += decoder.accepted[r] - a
        except Exception as e:  # noqa: BLE001 - every row of the cycle is involved; the engine serves on
            self._fail(decoder, [(r, h) for r, h in enumerate(self._handles) if h is not None], "decoding", e)
            return
        self._deliver(decoder, kept)

    def _run_commands(self) -> bool:
        """Run the queued adapter changes; True if one took effect (a refused or failed one changes nothing)."""
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
            self._adapters = list(self._paths)
            self.metrics["loaded_adapters"] = len(self.model.peft_config)

    # --- bounded adapters (the engine's thread) ---

    def _load(self, name: str, path: str) -> None:
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
                self._delete(name)
            raise
        self._used[name] = next(self._ticks)
        with self._state_lock:
            self.metrics["loads"] += 1

    def _delete(self, name: str) -> None:
        """PEFT's delete_adapter, another adapter made the active one first if ``name`` is: PEFT takes
        the next one from its first LoRA layer, and where that layer holds no other, the model's
        active adapter stays the deleted one (then every PEFT call on the model fails)."""
        if name in self.model.active_adapters:
            self.model.set_adapter(next(a for a in self.model.peft_config if a != name), inference_mode=True)
        self.model.delete_adapter(name)

    def _evictable(self, keep: str, running, idle: bool) -> list[str]:
        """Loaded adapters that may be evicted now, the best first: not ``keep``, not in ``running``
        (the batch's rows read them), with a known path (to load them again); ``idle``: nor any a
        waiting request names. Those no waiting request names first, then least recently used."""
        waiting = {h.request.adapter for h in self._waiting}
        return sorted((a for a in self.model.peft_config if a != keep and a not in running and self._paths.get(a)
                       and not (idle and a in waiting)), key=lambda a: (a in waiting, self._used[a]))

    def _fit(self, loaded: str, idle: bool) -> None:
        """After loading ``loaded``: if that makes one adapter more than max_cpu_loras, evict the
        first of ``_evictable`` (``loaded`` itself when there is none)."""
        if self.max_cpu_loras is None or len(self.model.peft_config) <= self.max_cpu_loras:
            return
        running = {h.request.adapter for h in self._handles if h is not None}
        victim = next(iter(self._evictable(loaded, running, idle)), loaded)
        self._delete(victim)
        with self._state_lock:
            self.metrics["evictions"] += 1
        logger.info("hf_invisiblelora engine: evicted adapter %r (max_cpu_loras=%d)", victim, self.max_cpu_loras)

    def _reload(self, name: str | None) -> bool:
        """Load the evicted adapter ``name`` that the first waiting request needs (``_pick`` saw
        room for it); True if it was loaded. If that fails, the requests waiting for it end with
        "error" (it stays served: a later request tries again)."""
        if name is None or name not in self._paths or name in self.model.peft_config:  # unloaded meanwhile
            return False
        try:
            self._load(name, self._paths[name])
            self._fit(name, idle=False)
        except Exception as e:  # noqa: BLE001 - only the requests for this adapter are involved
            logger.exception("hf_invisiblelora engine: loading adapter %r again failed", name)
            with self._wake:
                failed = [h for h in self._waiting if h.request.adapter == name]
                for h in failed:
                    self._waiting.remove(h)
                    h._finish("error", f"loading adapter {name!r} failed: {type(e).__name__}: {e}")
            with self._state_lock:
                self.metrics["failed_requests"] += len(failed)
            return name in self.model.peft_config
        finally:
            self._publish_adapters()
        return True

    def _pick(self, decoder: Decoder, free: int) -> tuple[list, str | None]:
        """The waiting requests that take the ``free`` rows now, and the evicted adapter to load
        first (or None). Called under _wake.

        First come, first served. A request whose adapter is not in the batch needs a slot (at most
        ``max_loras`` adapters in it) and its adapter loaded. The first one that cannot have them
        yet blocks: no request after it gets a slot first, and the batch's adapter whose rows have
        the fewest tokens left at most (the ``target``) takes no new rows, so it is done within
        that many cycles and frees a slot (and, evicted, room to load); the requests that need
        neither and are not the target's still join. Its adapter is loaded at once if
        ``_evictable`` has room for it."""
        rows, left = decoder.rows, {}  # the batch's adapters -> the most tokens one of their rows has left
        for r, h in enumerate(self._handles):
            if h is not None and h.request.adapter != BASE:
                left[h.request.adapter] = max(left.get(h.request.adapter, 0), rows.max_new_h[r] - rows.gen_h[r])
        picked, needed, target, blocked = [], None, None, False
        for h in self._waiting:
            if len(picked) == free:
                break
            a = h.request.adapter
            if a == BASE or a in left:
                if a != target:
                    picked.append(h)
                continue
            if blocked:
                continue
            slot = self.max_loras is None or len(left) < self.max_loras
            loaded = a in self.model.peft_config
            if loaded and slot:
                picked.append(h)
                left[a] = h.request.max_tokens
                continue
            blocked = True
            room = loaded or self.max_cpu_loras is None or len(self.model.peft_config) < self.max_cpu_loras \
                or bool(self._evictable(a, left, idle=False))
            if not loaded and room:
                needed = a
            if not (slot and room):  # wait for an adapter of the batch to be done (one that can be evicted, for room)
                target = min((b for b in left if room or self._paths.get(b)), key=left.get, default=None)
        return picked, needed

    def _admit(self, decoder: Decoder) -> str | None:
        """Waiting requests take the free rows (``_pick``), in prefill groups that fit; returns the
        evicted adapter to load before the first waiting request can join, or None."""
        free = [r for r, h in enumerate(self._handles) if h is None]
        if not free:
            return None
        with self._wake:
            picked, needed = self._pick(decoder, len(free))
            for h in picked:
                self._waiting.remove(h)
        joining = list(zip(free, picked))
        if not joining:
            return needed
        try:
            groups = self._groups(joining)
        except Exception as e:  # noqa: BLE001 - the joining requests are involved
            self._fail(decoder, joining, "admission", e)
            return needed
        for group in groups:
            self._prefill(decoder, group)
        return needed

    def _groups(self, joining: list) -> list[list]:
        """Split the joining (row, handle) pairs into prefill groups whose rows all fit.

        A group's prompts are left-padded to its longest one, P slots, so each of its rows needs
        P + max_tokens + K + 1 slots (validate() checks a request's own prompt length: prompt +
        max_tokens <= max_request_tokens <= max_len - K - 1; positions follow each row's own
        tokens, so padding costs slots, not positions). The fewest groups: take the longest prompt
        left, P; every request left whose max_tokens fits next to P joins it; repeat (every group
        must hold the longest prompt left, and this one holds all that could join it). Each
        request fits in a group of its own, so every validated request is admitted; groups go in
        the order of their first request, each in FIFO order."""
        room = self.max_len - self.num_draft_tokens - 1
        left, groups = list(joining), []
        while left:
            longest = max(left, key=lambda rh: len(rh[1].request.prompt))
            width = len(longest[1].request.prompt)
            group = [rh for rh in left if rh is longest or width + rh[1].request.max_tokens <= room]
            groups.append(group)
            left = [rh for rh in left if all(rh is not g for g in group)]
        return sorted(groups, key=lambda g: joining.index(g[0]))  # FIFO: by each group's first request

    def _prefill(self, decoder: Decoder, group: list) -> None:
        """One prefill of a group's rows (Decoder.admit), then delivery of their first tokens. If
        it raises, the group's requests end with "error" and the engine serves on (``_fail``)."""
        for r, h in group:
            self._handles[r] = h
            self._used[h.request.adapter] = next(self._ticks)
        with self._state_lock:
            self.metrics["requests"] += len(group)
        try:
            device = self.inner.device
            width = max(len(h.request.prompt) for _, h in group)
            ids = torch.full((len(group), width), self.pad_id, dtype=torch.long, device=device)
            mask = torch.zeros_like(ids)
            for i, (_, h) in enumerate(group):  # left-padded: a row's slots follow its own positions
                n = len(h.request.prompt)
                ids[i, width - n:] = torch.tensor(h.request.prompt, device=device)
                mask[i, width - n:] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            for r, h in group:
                stops = self._stops(decoder, r, h.request)
                decoder.policy.set_request(r, h.request, stops)
            kept = decoder.admit([r for r, _ in group], ids, mask, positions, [h.request.max_tokens for _, h in group],
                                 [h.request.adapter for _, h in group])
        except Exception as e:  # noqa: BLE001 - only the group is involved; the rows decoding go on
            self._fail(decoder, group, "prefill", e)
            return
        self._deliver(decoder, kept)

    def stop_ids(self, ignore_eos: bool, stop_token_ids) -> list[int]:
        """The token ids that end a request: the model's EOS ids (unless ignore_eos) and its stop_token_ids."""
        return list(dict.fromkeys(([] if ignore_eos else self.eos_ids) + list(stop_token_ids)))

    def _stops(self, decoder: Decoder, r: int, request: Request) -> list[int]:
        """Set row r's stop token ids in the decoder's per-row table (widened if they are more) and return them."""
        stops = self.stop_ids(request.ignore_eos, request.stop_token_ids)
        table = decoder.eos
        if len(stops) > table.shape[1]:
            table = torch.cat([table, table.new_full((table.shape[0], len(stops) - table.shape[1]), -1)], 1)
        table[r] = -1
        table[r, : len(stops)] = torch.tensor(stops, dtype=table.dtype, device=table.device)
        decoder.eos = table
        return stops

    def _deliver(self, decoder: Decoder, kept: list[int]) -> None:
        rows = decoder.rows
        try:
            # The committed tokens of every row in one copy to the host (one device sync, not one per row).
            tokens = rows.tokens[: len(kept)].tolist() if any(kept) else None
        except Exception as e:  # noqa: BLE001 - every row with tokens is involved
            self._fail(decoder, [(r, self._handles[r]) for r, n in enumerate(kept) if self._handles[r] is not None],
                       "delivery", e)
            return
        with self._state_lock:
            self.metrics["tokens"] += sum(n for r, n in enumerate(kept) if self._handles[r] is not None)
        for r, n in enumerate(kept):
            h = self._handles[r]
            if h is None:
                continue
            try:
                if n:
                    end = rows.plen_h[r] + rows.gen_h[r]
                    chunk, top = tokens[r][end - n : end], h.request.logprobs
                    logprobs = () if top is None else decoder.policy.token_logprobs(r, rows.gen_h[r] - n, chunk, top)
                    try:
                        stop = h._put(chunk, logprobs)
                    except Exception as e:  # noqa: BLE001 - the request's own callback failed: only it ends
                        rows.done_h[r] = True
                        self._release(decoder, r, "error", f"on_tokens raised {type(e).__name__}: {e}")
                        continue
                    if stop:
                        rows.done_h[r] = True
                        self._release(decoder, r, "stop")
                        continue
                if rows.done_h[r]:
                    reason = "length" if rows.gen_h[r] >= rows.max_new_h[r] and rows.stop_at[r] is None else "stop"
                    self._release(decoder, r, reason)
            except Exception as e:  # noqa: BLE001 - only this row is involved
                self._fail(decoder, [(r, h)], "delivery", e)

    def _fail(self, decoder: Decoder, involved: list, stage: str, error: Exception) -> None:
        """An unexpected exception in ``stage`` (called in its ``except``): the ``involved``
        (row, handle) pairs end with "error" and their rows are freed and reset, so the next
        admission starts them afresh; the other rows and the engine go on. If resetting fails too,
        the engine fails (``_run``)."""
        logger.exception("hf_invisiblelora engine: %s failed; ending %d request(s), serving on", stage, len(involved))
        message = f"the engine failed in {stage}: {type(error).__name__}: {error}"
        with self._state_lock:
            self.metrics["failed_cycles"] += 1
            self.metrics["failed_requests"] += sum(h is not None and h.finish_reason is None for _, h in involved)
        try:
            rows, room = decoder.rows, self.max_len - self.num_draft_tokens - 1
            for r, h in involved:  # a free row rides along in cycles: keep its slots in range, whatever was half-done
                rows.done_h[r], rows.stop_at[r] = True, None
                rows.gen_h[r], rows.plen_h[r] = 0, min(max(rows.plen_h[r], 1), room)
                decoder.names[r] = None
                if self._handles[r] is h:
                    self._handles[r] = None
                decoder.policy.release(r)
            rows.sync()
            decoder.lora.set_rows(decoder.names)
            decoder.fwd.set_rows(decoder.names)
        finally:  # the requests learn they failed even if the reset fails (and with it the engine)
            for r, h in involved:
                if h is not None:
                    h.drafted, h.accepted = decoder.drafted[r], decoder.accepted[r]
                    h._finish("error", message)

    def _drop_cancelled(self, decoder: Decoder) -> None:
        with self._wake:
            cancelled, self._cancelled = self._cancelled, set()
        for r, h in enumerate(self._handles):
            if h is not None and h.request.id in cancelled:
                decoder.rows.done_h[r] = True
                self._release(decoder, r, "cancelled")

    def _release(self, decoder: Decoder, r: int, reason: str, error: str | None = None) -> None:
        h = self._handles[r]
        h.drafted, h.accepted = decoder.drafted[r], decoder.accepted[r]
        self._used[h.request.adapter] = next(self._ticks)
        self._handles[r] = None
        decoder.names[r] = None
        decoder.policy.release(r)
        h._finish(reason, error)
