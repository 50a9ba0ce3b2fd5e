"""Structured outputs' grammars for the server: one tokenizer's compiler (``Grammars``).

A request's ``GrammarSpec`` (a JSON schema, any JSON, a regex, a list of choices, an EBNF grammar:
xgrammar's) is compiled in a worker process (grammar_worker.py) bounded in time and memory, so a
pathological regex or schema is refused and never stalls the server; a worker that dies of something
else is started again. Compiled grammars and refusals are remembered, and compilations run on a
thread of their own with a bounded queue. The compiled grammar's mask at every position a pass
scores is the decoding core's (decode/grammar.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import select
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from . import grammar_worker as _worker
from .grammar_worker import compile_spec as _compile_spec

logger = logging.getLogger("hf_invisiblelora")

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 16  # a schema, regex or grammar's text; longer: refused before compiling
STARTUP_SECONDS = 120
WORKER_TRIES = 3  # a worker ended from outside is started again (and asked again) so many times in a row
CRASHES = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}  # what a process raises itself
REFUSALS_KEPT = 4096  # refused grammars remembered (by digest)
MAX_PENDING = 8  # grammars waiting for Grammars.submit's thread at once; more: GrammarsBusy
MAX_SCHEMA_DEPTH = 128  # JSON levels of a schema (a body's own JSON nests at most 32: deeper ones come as text)


def _depth(value) -> int:
    """How deeply a JSON value nests (iteratively: a deep one does not exhaust Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d <= MAX_SCHEMA_DEPTH:
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()))
    return deepest


class GrammarError(ValueError):
    """A grammar that cannot be compiled: invalid, unsupported, or past the bounds (``param``: the
    request field it came from, when the caller set it)."""

    param = None


class CompilerUnavailable(RuntimeError):
    """The grammar compiler's process does not start, or is ended from outside again and again: the
    server's trouble, not the grammar's."""


class GrammarsBusy(RuntimeError):
    """Grammars.max_pending grammars wait to be compiled already."""


class _Ended(Exception):
    """The worker's output ended: it exited."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. ``kind``: one of KINDS; ``value``: the JSON schema
    (a dict or its text), the regex, the choices (a list of strings), the EBNF grammar (xgrammar's,
    GBNF-like: ``root ::= ...``); None for json_object."""

    kind: str
    value: object = None

    def key(self) -> tuple:
        """A canonical, hashable form: the cache's key, and what the worker compiles."""
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; kinds: {', '.join(KINDS)}")
        value = self.value
        if self.kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except RecursionError:
                    raise GrammarError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
                except ValueError as e:
                    raise GrammarError(f"the JSON schema is not JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise GrammarError("a JSON schema is an object")
            if _depth(value) > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            value = json.dumps(value, separators=(",", ":"))  # key order kept: xgrammar writes properties in it
        elif self.kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise GrammarError("choices are a non-empty list of non-empty strings")
            value = json.dumps(list(value))
        elif self.kind == "json_object":
            value = ""
        elif not isinstance(value, str) or not value:
            raise GrammarError(f"a {self.kind} is a non-empty string")
        if len(value) > MAX_SPEC_CHARS:
            raise GrammarError(f"the {self.kind} is {len(value)} characters; at most {MAX_SPEC_CHARS}")
        return self.kind, value


def compile_spec(compiler, key: tuple):
    """``key`` (GrammarSpec.key) compiled by an xgrammar GrammarCompiler (grammar_worker.compile_spec:
    JSON on one line, json_object any JSON object)."""
    return _compile_spec(compiler, *key)


class Grammars:
    """One tokenizer's grammars. Each is tried first in a worker process (grammar_worker.py): one that
    takes longer than ``timeout`` seconds there (the process is killed; a new one starts for the
    next), needs more than ``max_bytes`` of memory, or crashes it, is refused (GrammarError); one
    that compiled there is compiled here. Compiled grammars are kept, least recently used dropped
    past ``cache_bytes``; refusals are remembered (REFUSALS_KEPT, by digest), so a grammar refused
    before is refused at once while the bounds are no looser than those it was refused under.

    A worker that dies of anything but its grammar (killed from outside, while idle, starting or
    compiling) is started again and the grammar tried again, up to WORKER_TRIES times, then
    CompilerUnavailable: a dead worker is never the grammar's refusal.

    Compilations run one at a time: ``compile`` in the caller's thread, ``submit`` on this
    compiler's own thread, with at most ``max_pending`` grammars waiting for it (GrammarsBusy past
    that), so a server's slow compilations hold no thread of a pool its other requests need.

    ``vocab_size``: the model's logits' width (xgrammar's TokenizerInfo pads the tokenizer's vocabulary
    to it: tokens past the tokenizer's are never allowed); ``stop_token_ids``: the tokens a
    grammar may end with (the request's own stops replace them in the engine)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=None, timeout: float = 10.0,
                 max_bytes: int = 1 << 30, cache_bytes: int = 256 << 20, max_pending: int = MAX_PENDING):
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._info_json = self.info.serialize_json()
        self._compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.timeout, self.max_bytes, self.cache_bytes = timeout, max_bytes, cache_bytes
        self.max_pending = max_pending
        self._cache: OrderedDict = OrderedDict()  # key -> CompiledGrammar
        self._cached_bytes = 0
        self._refused: OrderedDict = OrderedDict()  # key's digest -> (message, the timeout and max_bytes then)
        self._pending: dict = {}  # key -> the Future of submit() compiling it
        self._lock = threading.Lock()  # one compilation at a time
        self._cache_lock = threading.Lock()  # what is known and pending: a cached grammar waits for no compilation
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf_invisiblelora-grammars")
        self._process = None

    def start(self) -> "Grammars":
        """Start the worker now (a second or two: it imports xgrammar), not at the first request's
        expense."""
        with self._lock:
            self._ensure_worker()
        return self

    def _ensure_worker(self) -> None:
        """A worker ready for a grammar: the one running, else a new one (CompilerUnavailable if none starts)."""
        if self._process is not None:
            if self._process.poll() is None:
                return
            logger.warning("the grammar compiler's process ended (%s); starting another", _status(self._kill()))
        for _ in range(WORKER_TRIES):
            self._process = subprocess.Popen([sys.executable, "-P", _worker.__file__, str(self.max_bytes)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             text=True, bufsize=1)
            self._send(self._info_json)
            try:  # its start (importing xgrammar, torch) is not a compilation's time
                if self._answer(STARTUP_SECONDS) == ["ready"]:
                    return
                break  # no answer in time: it will not start
            except _Ended:
                logger.warning("the grammar compiler's process ended while starting (%s); starting another",
                               _status(self._kill(wait=5)))
        self._kill()
        raise CompilerUnavailable("the grammar compiler's process did not start")

    def _send(self, line: str) -> None:
        try:
            self._process.stdin.write(line + "\n")
            self._process.stdin.flush()
        except OSError:
            pass  # it died: its output ends, and its exit status says why

    def _answer(self, timeout: float):
        """The worker's next line (JSON), or None if none comes within ``timeout`` seconds; _Ended if
        its output ends (it exited)."""
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self._process.stdout.readline()
        if not line:
            raise _Ended
        return json.loads(line)

    def _kill(self, wait: float = 0) -> int | None:
        """End the worker: waited for up to ``wait`` seconds (its output ended: it is exiting), else
        killed; its pipes closed. Its exit status (minus the signal's number when a signal ended it)."""
        process, self._process = self._process, None
        if process is None:
            return None
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):  # a line it never read flushed into a closed pipe
                stream.close()
        return process.returncode

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _known(self, key: tuple):
        """The CompiledGrammar of ``key`` if it was compiled, else None; GrammarError if it was refused
        under bounds no tighter than these."""
        digest = _digest(key)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            refused = self._refused.get(digest)
            if refused is not None and self.timeout <= refused[1] and self.max_bytes <= refused[2]:
                raise GrammarError(refused[0])
        return None

    def compile(self, spec: GrammarSpec):
        """The CompiledGrammar of ``spec``; GrammarError if it is invalid or past the bounds,
        CompilerUnavailable if the worker cannot be run."""
        return self._compile(spec, spec.key())

    def submit(self, spec: GrammarSpec) -> Future:
        """A Future of ``spec``'s CompiledGrammar (``compile``), compiled on this compiler's own thread;
        done already if it was compiled before. Never waits: GrammarError at once for an invalid spec
        or one refused before, GrammarsBusy when ``max_pending`` other grammars wait already; the
        callers of a grammar that waits share its Future. Call it off an event loop: reading a large
        schema takes a while."""
        key = spec.key()
        compiled = self._known(key)
        if compiled is not None:
            future = Future()
            future.set_result(compiled)
            return future
        with self._cache_lock:
            if key in self._pending:
                return self._pending[key]
            if len(self._pending) >= self.max_pending:
                raise GrammarsBusy(f"{len(self._pending)} grammars are waiting to be compiled already")
            future = self._pending[key] = self._executor.submit(self._compile, spec, key)
        future.add_done_callback(lambda _: self._finished(key))  # not under the lock: it may run at once
        return future

    def _finished(self, key: tuple) -> None:
        with self._cache_lock:
            del self._pending[key]

    def _compile(self, spec: GrammarSpec, key: tuple):
        compiled = self._known(key)
        if compiled is not None:
            return compiled
        with self._lock:
            compiled = self._known(key)  # compiled, or refused, meanwhile by the call this one waited for
            if compiled is not None:
                return compiled
            try:
                self._try(spec, key)
                try:
                    compiled = compile_spec(self._compiler, key)  # as long as it took there, within the bounds
                except Exception as e:  # noqa: BLE001 - what compiled there does here; a request's error if not
                    text = str(e).strip()
                    raise GrammarError(f"invalid {spec.kind}: {text.splitlines()[0] if text else repr(e)}") from None
            except GrammarError as e:
                with self._cache_lock:
                    self._refused[_digest(key)] = (str(e), self.timeout, self.max_bytes)
                    while len(self._refused) > REFUSALS_KEPT:
                        self._refused.popitem(last=False)
                raise
            with self._cache_lock:
                self._cache[key] = compiled
                self._cached_bytes += compiled.memory_size_bytes
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.memory_size_bytes
            return compiled

    def _try(self, spec: GrammarSpec, key: tuple) -> None:
        """Compile ``key`` in the worker, within the bounds (GrammarError if not). A worker that ends on
        its own (a signal it raised itself, as a crash does, or an exit status) ended on the grammar,
        which is refused; one ended by any other signal was ended from outside: started again."""
        for _ in range(WORKER_TRIES):
            self._ensure_worker()
            self._send(json.dumps(key))
            try:
                answer = self._answer(self.timeout)
            except _Ended:
                status = self._kill(wait=5)
                if status > 0 or -status in CRASHES:
                    raise GrammarError(f"compiling the {spec.kind} crashed the grammar compiler ({_status(status)}: past "
                                       "the memory a grammar may use, or a fault of xgrammar's)") from None
                logger.warning("the grammar compiler's process ended (%s) before its answer; compiling again in a "
                               "new one", _status(status))
                continue
            if answer is None:  # our bound
                self._kill()
                raise GrammarError(f"the {spec.kind} takes longer than {self.timeout:g} s to compile")
            if answer[0] != "ok":
                raise GrammarError(answer[1] if answer[1] == _worker.MEMORY else f"invalid {spec.kind}: {answer[1]}")
            return
        raise CompilerUnavailable(f"the grammar compiler's process was ended {WORKER_TRIES} times in a row")


def _digest(key: tuple) -> bytes:
    return hashlib.sha256(json.dumps(key).encode()).digest()


def _status(code: int) -> str:
    """A process's exit status in words: the signal's name, or the exit code."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
        return f"signal {-code}"
    return f"exit status {code}"
