"""An OpenAI-compatible HTTP server on the continuous-batching engine (engine.py).

    python -m hf_invisiblelora.serve --model BASE_PATH --lora poetry=adapters/poetry --lora python=adapters/python
    python -m hf_invisiblelora.serve --zoo smollm2 [--adapters shakespeare kjv ...]

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with ``stream``), ``/v1/models``,
``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/health``, ``/metrics`` (Prometheus).
The ``model`` field of a request names the adapter (as in vLLM); the base model's id (or
``"__base__"``) means no adapter. Errors are OpenAI error objects with the matching status.
docs/serving.md describes the API, the options, the errors and the metrics.

Needs the ``serve`` extra (``pip install "hf-invisiblelora[serve]"``: FastAPI, uvicorn,
prometheus-client); ``--zoo`` also needs ``zoo``.

How a request runs: the handler validates it (400 / 404 before anything is queued), tokenizes the
prompt and submits an ``engine.Request``. A small thread per request iterates the engine's
``Handle`` and hands each chunk of committed tokens to the event loop
(``loop.call_soon_threadsafe``); the handler detokenizes incrementally (the whole token list is
decoded and the new suffix emitted, holding back an incomplete multi-byte character and any tail
that could start a stop string). Stop strings are checked on the engine's thread by the request's
``on_tokens`` callback (returning True ends the request at that cycle) and the text is cut before
the stop string. A client that disconnects cancels its request (its row is freed at the next
cycle). Nothing about a request is kept after it finishes.

What is guarded (docs/serving.md, "Security model"): with ``--api-key`` every ``/v1`` route wants
``Authorization: Bearer KEY``; a POST body must be ``application/json`` (a web page cannot send that
cross-site without a CORS preflight) and at most ``--max-body-bytes``; adapters load at run time only
with ``--allow-runtime-lora-updating``, from local folders inside the ``--lora-root`` folders. No
response holds an exception's text: a 500 gives a request id (``X-Request-Id``), the log the details.
SIGTERM drains: new requests get 503 while those in flight finish, for up to ``--shutdown-timeout`` s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import sys
import threading
import time
import uuid

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException

from .checks import BASE
from .engine import (
    MAX_LOGPROBS,
    AdapterBusy,
    AdapterExists,
    AdapterUnsupported,
    LastAdapter,
    NotRunning,
    PromptTooLong,
    QueueFull,
    UnknownAdapter,
)

logger = logging.getLogger("hf_invisiblelora.serve")

DTYPES = ("float32", "float64", "bfloat16", "float16")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_BODY_BYTES = 4 * 2**20  # --max-body-bytes: room for a 1 MB prompt, or a list of a million token ids
MAX_JSON_DEPTH = 32  # the requests' own bodies are 5 deep (messages, content parts)
MAX_INT_DIGITS = 20  # 2**64, one past the largest seed, has 20
SHUTDOWN_TIMEOUT = 30  # --shutdown-timeout, seconds
API_KEY_ENV = "HF_INVISIBLELORA_API_KEY"
RUNTIME_LORA_ENV = "HF_INVISIBLELORA_ALLOW_RUNTIME_LORA_UPDATING"  # as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
REQUEST_ID = "X-Request-Id"


# --- errors ---


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.
    ``cause``: an unexpected exception behind it, logged with the request id (its text is never in
    the body, which says what is wrong in our words)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None, cause: BaseException | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers, self.cause = headers, cause

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(model: str) -> ApiError:
    return ApiError(404, f"The model {_show(model)} does not exist.", param="model", code="model_not_found")


def internal_error(request_id: str) -> ApiError:
    return ApiError(500, f"Internal error (request id {request_id}); the server's log has the details.",
                    type="server_error", code="internal_error")


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; retry later or elsewhere.", type="server_error",
                    code="server_shutting_down", headers={"Connection": "close"})


def _show(value) -> str:
    """A client's value as error messages quote it: its repr, cut short (a value can be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


# --- request parameters ---


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise _bad(name, f"`{name}` must be {'an integer' if integer else 'a number'}, got {_show(value)}.")
    if not integer:
        value = float(value)  # Transformers' warpers want floats
        if not math.isfinite(value):
            raise _bad(name, f"`{name}` must be finite, got {_show(value)}.")
    return value


def _unsupported(body: dict, name: str, allowed=(None,)) -> None:
    if body.get(name) not in allowed:
        raise ApiError(400, f"`{name}` is not supported by this server (got {_show(body[name])}).", param=name,
                       code="unsupported_parameter")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(name, f"`{name}` must be a boolean, got {_show(value)}.")
    return bool(value)


# Fields a request may carry. Honoured: what Sampling reads. Neutral: accepted at the value that
# asks for nothing (vLLM's and OpenAI's defaults), refused otherwise. Anything else is refused by
# name, as OpenAI's API refuses an unrecognized argument: a field nobody reads must not pass as honoured.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
                 "include_stop_str_in_output", "stream", "stream_options", "min_tokens", "ignore_eos",
                 "repetition_penalty", "logprobs", "echo", "user", "return_tokens_as_token_ids"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                               "continue_final_message"}
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "best_of": (1,),
           "suffix": ("",), "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
           "use_beam_search": (False,), "prompt_logprobs": (), "truncate_prompt_tokens": (),
           "return_token_ids": (False,), "structured_outputs": (), "guided_json": (), "guided_regex": (),
           "guided_choice": (), "guided_grammar": (), "guided_decoding_backend": (), "response_format": (),
           "skip_special_tokens": (True,), "chat_template": (), "chat_template_kwargs": (), "parallel_tool_calls": ()}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
MAX_N = 16  # choices per request: each takes a row of the engine


class Sampling:
    """A completion or chat request's parameters, validated: every field either honoured, neutral
    (NEUTRAL) or refused with a 400 naming it (docs/serving.md lists them)."""

    def __init__(self, body: dict, chat: bool):
        known = CHAT_FIELDS if chat else COMPLETION_FIELDS
        for name in body:
            if name not in known and name not in NEUTRAL:
                shown = name if len(name) <= 64 and name.isprintable() else _show(name)
                raise ApiError(400, f"Unknown parameter `{shown}`.", param=shown, code="unsupported_parameter")
        for name, allowed in NEUTRAL.items():
            if name == "response_format" and chat:
                allowed = ({"type": "text"},)
            _unsupported(body, name, (None, *allowed))
        self.n = _number(body, "n", 1, integer=True)
        if not 1 <= self.n <= MAX_N:
            raise _bad("n", f"`n` must be in [1, {MAX_N}], got {self.n}.")
        self.temperature = _number(body, "temperature", 1.0)
        if self.temperature < 0:
            raise _bad("temperature", f"`temperature` must be >= 0, got {self.temperature}.")
        self.top_p = _number(body, "top_p", 1.0)
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", f"`top_p` must be in (0, 1], got {self.top_p}.")
        self.top_k = _number(body, "top_k", 0, integer=True)  # an extension (vLLM's): 0 or -1 = no limit
        if self.top_k < -1:
            raise _bad("top_k", f"`top_k` must be >= 1, or 0 / -1 for no limit; got {self.top_k}.")
        self.top_k = max(self.top_k, 0)
        self.min_p = _number(body, "min_p", 0.0)
        if not 0 <= self.min_p <= 1:
            raise _bad("min_p", f"`min_p` must be in [0, 1], got {self.min_p}.")
        self.repetition_penalty = _number(body, "repetition_penalty", 1.0)
        if not self.repetition_penalty > 0:
            raise _bad("repetition_penalty", f"`repetition_penalty` must be > 0, got {self.repetition_penalty}.")
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        self.max_tokens = None
        for name in names:
            value = _number(body, name, None, integer=True)
            if value is not None and value < 1:
                raise _bad(name, f"`{name}` must be >= 1, got {value}.")
            self.max_tokens = self.max_tokens or value
        self.min_tokens = _number(body, "min_tokens", 0, integer=True)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise _bad("min_tokens", f"`min_tokens` must be in [0, max_tokens], got {self.min_tokens}.")
        self.seed = _number(body, "seed", None, integer=True)  # its range: the engine's check
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", "`stop` must be a non-empty string or a list of them.")
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"At most {MAX_STOP_STRINGS} stop strings, got {len(stop)}.")
        self.stop = stop
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _bad("stop_token_ids", "`stop_token_ids` must be a list of token ids.")
        self.stop_token_ids = ids
        self.include_stop = _flag(body, "include_stop_str_in_output")
        self.ignore_eos = _flag(body, "ignore_eos")
        self.echo = _flag(body, "echo")
        self.token_ids_as_text = _flag(body, "return_tokens_as_token_ids")  # vLLM's: logprobs' tokens as "token_id:N"
        self.stream = _flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or (options and not self.stream) or set(options) - STREAM_OPTIONS:
            raise _bad("stream_options", "`stream_options` must be an object of include_usage and "
                       "continuous_usage_stats, and only given with stream=true.")
        self.include_usage = _flag(options, "include_usage")
        self.continuous_usage = _flag(options, "continuous_usage_stats")
        self.add_generation_prompt = self.continue_final = False
        if chat:  # logprobs: true and top_logprobs: N, as OpenAI's chat API takes them
            if not _flag(body, "logprobs"):
                _unsupported(body, "top_logprobs", (None,))
                self.logprobs = None
            else:
                self.logprobs = _number(body, "top_logprobs", 0, integer=True)
            self.add_generation_prompt = body.get("add_generation_prompt", True)
            self.continue_final = _flag(body, "continue_final_message")
            if not isinstance(self.add_generation_prompt, bool) or (self.add_generation_prompt and self.continue_final):
                raise _bad("continue_final_message", "`continue_final_message` continues the last message, so it "
                           "needs add_generation_prompt=false.")
        else:  # logprobs: N, the most likely tokens besides the chosen one (0: the chosen one's only)
            self.logprobs = _number(body, "logprobs", None, integer=True)
            if self.echo and self.logprobs is not None:
                raise ApiError(400, "`echo` with `logprobs` asks for the prompt's log-probabilities, which this server "
                               "does not compute.", param="echo", code="unsupported_parameter")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            param = "top_logprobs" if chat else "logprobs"
            raise _bad(param, f"`{param}` must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")

    def request(self, prompt: list[int], adapter: str, max_tokens: int, seed, on_tokens):
        """The engine's Request for one choice."""
        from .engine import Request  # fastapi's Request is this module's

        return Request(prompt, adapter=adapter, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                       min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids),
                       ignore_eos=self.ignore_eos, logprobs=self.logprobs, seed=seed, on_tokens=on_tokens)


class Stops:
    """Where a request's text ends: at the first stop string that ends past the text of its first
    ``min_tokens - 1`` tokens (none counts before min_tokens tokens, as in vLLM), the stop string
    cut off unless ``include``; a stop token ending the request (its EOS ids unless ignore_eos, its
    stop_token_ids) leaves its text out unless ``include``, as vLLM does."""

    def __init__(self, strings=(), min_tokens: int = 0, include: bool = False, token_ids=()):
        self.strings, self.min_tokens, self.include = list(strings), min_tokens, include
        self.token_ids = set(token_ids)

    def cut(self, decode, tokens: list[int]) -> int | None:
        """Where the text of ``tokens`` (``decode`` gives it) ends, or None: no stop string in it."""
        if not self.strings or len(tokens) < self.min_tokens:
            return None
        text = decode(tokens)
        floor = len(decode(tokens[: self.min_tokens - 1])) if self.min_tokens > 1 else 0
        found = []
        for s in self.strings:
            i = text.find(s, max(0, floor - len(s) + 1))
            if i >= 0:
                found.append((i, i + len(s)))
        if not found:
            return None
        start, end = min(found)
        return end if self.include else start

    def text_tokens(self, tokens: list[int]) -> list[int]:
        """The tokens whose text is shown: a stop token at the end left out unless ``include``."""
        return tokens[:-1] if tokens and not self.include and tokens[-1] in self.token_ids else tokens


def held_tail(text: str, stops) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string: held back
    while streaming, since the next tokens may complete the stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStream:
    """One request's text, detokenized incrementally: the whole token list is decoded after each
    chunk and the new suffix is emitted, so a multi-byte character split across tokens is never
    emitted half (an incomplete one decodes as U+FFFD and is held back until it completes). The
    text ends where ``stops`` (a Stops) says, and a tail that could start a stop string is held back
    until it is known not to. ``prefix``: text before the output (echo)."""

    def __init__(self, tokenizer, stops: Stops | None = None, prefix: str = ""):
        self.tokenizer, self.stops, self.prefix = tokenizer, stops or Stops(), prefix
        self.tokens: list[int] = []
        self.text = prefix
        self.sent = 0  # characters emitted
        self.stopped = False
        self.completion_tokens = 0  # tokens up to (and including) the one that completed a stop string

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> str:
        """Take a chunk of committed tokens; return the text now safe to emit."""
        if self.stopped or not tokens:
            return ""
        before = len(self.tokens)
        self.tokens += tokens
        cut = self.stops.cut(self._decode, self.tokens)
        if cut is None:
            text = self._decode(self.stops.text_tokens(self.tokens))
            self.text, self.completion_tokens = self.prefix + text, len(self.tokens)
            safe = len(text.rstrip("\ufffd"))
            safe = len(self.prefix) + safe - held_tail(text[:safe], self.stops.strings)
        else:
            self.stopped = True
            self.text = self.prefix + self._decode(self.tokens)[:cut]
            safe = len(self.text)
            self.completion_tokens = next((i for i in range(before + 1, len(self.tokens) + 1)
                                           if self.stops.cut(self._decode, self.tokens[:i]) is not None),
                                          len(self.tokens))
        return self._emit(safe)

    def finish(self) -> str:
        """The rest of the text, held back or not."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:upto], upto
        return delta


class StopWatch:
    """A request's ``on_tokens`` callback (runs on the engine's thread): True once a stop string
    ends the text (``stops``), which ends the request at that cycle. Never raises (an exception
    there would stop the engine): on an error it ends the request."""

    def __init__(self, tokenizer, stops: Stops):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []

    def __call__(self, tokens: list[int]) -> bool:
        try:
            self.tokens += tokens
            return self.stops.cut(lambda t: self.tokenizer.decode(t, skip_special_tokens=True), self.tokens) is not None
        except Exception:  # noqa: BLE001
            logger.exception("stop-string check failed; ending the request")
            return True


# --- the bridge from the engine's thread to asyncio ---


class ClientGone(Exception):
    pass


class Job:
    """One choice of a request: its engine request and handle, its text and the log-probabilities
    not yet sent. A thread iterates the handle and hands each chunk to the event loop, into the
    queue the request's choices share."""

    def __init__(self, server: "Server", request, stops: Stops, index: int, queue: asyncio.Queue, prefix: str = "",
                 token_ids_as_text: bool = False):
        self.server, self.index, self.queue, self.token_ids_as_text = server, index, queue, token_ids_as_text
        self.loop = asyncio.get_running_loop()
        self.text = TextStream(server.tokenizer, stops, prefix)
        self.start = time.perf_counter()
        self.offset = len(prefix)  # text_offset of the next token (completions' logprobs)
        self.logprobs_sent = 0
        self.handle = server.engine.submit(request)  # ValueError for a bad request
        server.in_flight[request.id] = self
        threading.Thread(target=self._pump, name=f"hf_invisiblelora-request-{request.id}", daemon=True).start()

    def _pump(self) -> None:
        try:
            for chunk in self.handle:
                self._send(chunk)
        finally:
            self._send(None)

    def _send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self, item))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    @property
    def finish_reason(self) -> str:
        return "stop" if self.text.stopped else self.handle.finish_reason

    def logprobs(self, chat: bool):
        """The log-probabilities of the tokens shown since the last call, in the API's shape (None if not asked)."""
        if self.handle.request.logprobs is None:
            return None
        upto = self.text.completion_tokens
        tokens = self.handle.tokens[self.logprobs_sent:upto]
        entries = self.handle.logprobs[self.logprobs_sent:upto]
        self.logprobs_sent = max(upto, self.logprobs_sent)
        decode = (lambda t: f"token_id:{t}") if self.token_ids_as_text else self.server.token_text
        if chat:
            def item(t, lp):
                text = decode(t)
                return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                                for t, (lp, top) in zip(tokens, entries)]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in zip(tokens, entries):
            text = decode(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp))
            out["top_logprobs"].append({**{decode(i): _finite(v) for i, v in top}, text: _finite(lp)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def close(self) -> None:
        """Cancel the request if it is not finished (a client that went away) and forget it."""
        if self.handle.finish_reason is None:
            self.handle.cancel()
            reason = "cancelled"
        else:
            reason = self.finish_reason
        if self.server.in_flight.pop(self.handle.request.id, None) is not None:
            self.server.metrics.finished.labels(reason).inc()
            self.server.metrics.latency.observe(time.perf_counter() - self.start)


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf (vLLM clamps the same way)


class Completion:
    """One completion request: its ``n`` choices (Jobs) and what they share (id, prompt, queue)."""

    def __init__(self, id: str, model_name: str, prompt_tokens: int):
        self.id, self.model_name, self.prompt_tokens = id, model_name, prompt_tokens
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs: list[Job] = []
        self.first_token_s = None

    async def chunks(self):
        """(job, chunk of committed tokens) as they come, until every choice has finished."""
        left = len(self.jobs)
        while left:
            job, chunk = await self.queue.get()
            if chunk is None:
                left -= 1
                continue
            if self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.jobs[0].start
                self.jobs[0].server.metrics.ttft.observe(self.first_token_s)
            yield job, chunk

    async def collect(self, request) -> None:
        """Take every chunk (a non-streaming call); a client that disconnects meanwhile raises ClientGone."""
        async def consume():
            async for job, chunk in self.chunks():
                job.text.add(chunk)
            for job in self.jobs:
                job.text.finish()

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        consumer, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait((consumer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            consumer.cancel()  # a no-op once it is done
        if consumer not in done:
            raise ClientGone()
        consumer.result()

    def usage(self) -> dict:
        completion = sum(job.text.completion_tokens for job in self.jobs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def close(self) -> None:
        for job in self.jobs:
            job.close()


# --- metrics ---


class Metrics:
    """Prometheus metrics in a registry of their own: the engine's figures read at scrape time
    (engine.metrics, queue_length(), running()) plus the server's own counters."""

    def __init__(self, engine, model_id: str):
        self.engine, self.model_id = engine, model_id
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.http = Counter("hf_invisiblelora_http_requests", "HTTP requests by endpoint and status code.",
                            ["endpoint", "status"], registry=self.registry)
        self.finished = Counter("hf_invisiblelora_requests_finished",
                                "Completions finished, by finish reason (stop, length, cancelled, error).",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("hf_invisiblelora_prompt_tokens", "Prompt tokens of submitted requests.",
                                     registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("hf_invisiblelora_time_to_first_token_seconds",
                              "From submission to the first committed tokens.", buckets=buckets, registry=self.registry)
        self.latency = Histogram("hf_invisiblelora_request_latency_seconds",
                                 "From submission to the end of the request.", buckets=buckets, registry=self.registry)

    def snapshot(self) -> dict:
        return self.engine.metrics_snapshot()

    def collect(self):
        m = self.snapshot()
        yield CounterMetricFamily("hf_invisiblelora_generated_tokens",
                                  "Tokens committed to requests (tokens/s: its rate).", value=m.get("tokens", 0))
        yield CounterMetricFamily("hf_invisiblelora_requests", "Requests admitted into a row of the engine.",
                                  value=m.get("requests", 0))
        yield CounterMetricFamily("hf_invisiblelora_cycles", "Decoder cycles run by the engine.", value=m.get("cycles", 0))
        yield CounterMetricFamily("hf_invisiblelora_failed_cycles",
                                  "Engine steps (a prefill, a decoder cycle, a delivery) that raised; the engine "
                                  "served on.",
                                  value=m.get("failed_cycles", 0))
        yield CounterMetricFamily("hf_invisiblelora_failed_requests",
                                  "Requests ended with an error by a failed engine step they were in.",
                                  value=m.get("failed_requests", 0))
        yield CounterMetricFamily("hf_invisiblelora_adapter_loads", "Adapters loaded into the model (at run time, "
                                  "or again after an eviction).", value=m.get("loads", 0))
        yield CounterMetricFamily("hf_invisiblelora_adapter_evictions",
                                  "Idle adapters unloaded to stay within --max-cpu-loras.", value=m.get("evictions", 0))
        yield GaugeMetricFamily("hf_invisiblelora_loaded_adapters", "Adapters loaded in the model now.",
                                value=m.get("loaded_adapters", 0))
        yield GaugeMetricFamily("hf_invisiblelora_queue_length", "Requests waiting for a row.",
                                value=self.engine.queue_length())
        yield GaugeMetricFamily("hf_invisiblelora_running_rows", "Rows decoding a request.", value=self.engine.running())
        yield GaugeMetricFamily("hf_invisiblelora_max_batch", "Rows of the engine.", value=self.engine.max_batch)
        for key, doc in (("drafted", "Draft tokens proposed for finished requests, per adapter."),
                         ("accepted", "Draft tokens the verify pass kept for finished requests, per adapter.")):
            family = CounterMetricFamily(f"hf_invisiblelora_{key}_tokens", doc, labels=["adapter"])
            for name, value in sorted(m.get(key, {}).items()):
                family.add_metric([name], value)
            yield family
        hist = m.get("k_hist", {})
        top = max([self.engine.num_draft_tokens, *hist])
        buckets, total = [], 0
        for k in range(top + 1):
            total += hist.get(k, 0)
            buckets.append((str(float(k)), total))
        buckets.append(("+Inf", total))
        yield HistogramMetricFamily("hf_invisiblelora_draft_tokens_per_cycle",
                                    "Tokens drafted per cycle (k; 0: a plain step), as the gate chose.",
                                    buckets=buckets, sum_value=sum(k * n for k, n in hist.items()))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# --- request bodies ---


async def json_body(request, limit: int) -> dict:
    """The request's body, a JSON object of at most ``limit`` bytes. Only ``application/json`` is
    read: a web page can POST text/plain or a form cross-site without a CORS preflight, so any other
    content type is refused (415) before anything runs."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, "The request body must be JSON, sent with `Content-Type: application/json`.",
                       code="unsupported_media_type")
    # Counted here, not with FastAPI's max_body_size: that one answers a plain-text 413, not an error object.
    too_large = ApiError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                         code="request_too_large")
    if int(request.headers.get("content-length") or 0) > limit:  # the HTTP parser has checked it is a number
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return await run_in_threadpool(parse_json, b"".join(chunks))  # a body of megabytes takes a while


def _bounded_int(text: str) -> int:
    # A JSON integer of thousands of digits costs quadratic time to convert (Python refuses over 4300
    # with a ValueError), and no field takes one: they are refused unconverted.
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ApiError(400, f"Integers in the request may have at most {MAX_INT_DIGITS} digits.", code="invalid_value")
    return int(text)


def _is_text(text: str) -> bool:
    """Whether ``text`` is Unicode text: JSON's escapes can make lone surrogates, which UTF-8 cannot encode."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_json(raw: bytes) -> dict:
    """The JSON object in ``raw``; a 400 for anything else, and for what JSON allows but nothing here
    can take: nesting deeper than MAX_JSON_DEPTH, huge integers (_bounded_int) and text with lone
    surrogates (from escapes like "\\ud800"), on which the tokenizer and the encoder of our
    responses fail."""
    too_deep = ApiError(400, f"The request body is nested too deeply (at most {MAX_JSON_DEPTH} levels).",
                        code="invalid_json")
    try:
        body = json.loads(raw, parse_int=_bounded_int)
    except RecursionError:
        raise too_deep from None
    except UnicodeDecodeError:
        raise ApiError(400, "The request body is not UTF-8 text.", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"The request body is not valid JSON (at line {e.lineno}, column {e.colno}).",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")

    def lone_surrogate(field):
        return ApiError(400, f"{f'`{field}`' if field else 'A key'} holds text with a lone surrogate (such as "
                        "\\ud800), which is not Unicode text.", param=field, code="invalid_value")

    stack = [(body, None, 1)]  # (object or array, the top-level field it is in, its depth)
    while stack:  # not recursive: a deep body must not exhaust the stack
        container, field, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep
        for key, value in container.items() if isinstance(container, dict) else enumerate(container):
            if isinstance(key, str) and not _is_text(key):
                raise lone_surrogate(None)
            where = key if depth == 1 else field
            if isinstance(value, str) and not _is_text(value):
                raise lone_surrogate(where)
            if isinstance(value, (list, dict)):
                stack.append((value, where, depth + 1))
    return body


# --- the server ---


class Server:
    """The HTTP side of one engine: request parsing, the bridge, the routes (``build_app``).

    ``root``: the base model's folder; ``adapter_paths``: each adapter's folder (both as given, for
    /v1/models). ``api_key``: None, or what ``Authorization: Bearer`` must carry on /v1; adapters
    load at run time only if ``runtime_updates``, from inside ``lora_roots`` (resolved folders;
    none: anywhere); bodies of at most ``max_body_bytes``."""

    def __init__(self, engine, tokenizer, model_id: str, root: str | None = None,
                 adapter_paths: dict[str, str] | None = None, *, api_key: str | None = None,
                 runtime_updates: bool = False, lora_roots: list[str] = (), max_body_bytes: int = MAX_BODY_BYTES):
        self.engine, self.tokenizer, self.model_id, self.root = engine, tokenizer, model_id, root
        # Loaded adapters and those being loaded: a name in it is taken (load_adapter).
        self.adapter_paths = dict(adapter_paths or {})
        self.api_key, self.runtime_updates, self.lora_roots = api_key, runtime_updates, list(lora_roots)
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.vocab = engine.inner.get_input_embeddings().num_embeddings
        self.in_flight: dict[int, Job] = {}
        self.metrics = Metrics(engine, model_id)
        self.encode_lock = threading.Lock()  # one fast tokenizer is not safe to call from several threads
        self.draining = False  # SIGTERM: new requests get 503 (Graceful)
        self.active = 0  # HTTP requests being answered (FrontDoor)

    # helpers

    def alive(self) -> bool:
        return self.engine.alive

    def unavailable(self) -> ApiError:
        if self.draining:
            return shutting_down()
        return ApiError(503, "The decoding engine is not running (see the server's log).", type="server_error",
                        code="engine_unavailable")

    def check_alive(self) -> None:
        if not self.alive():
            raise self.unavailable()

    def adapter_for(self, model) -> str:
        if model is None or model in (self.model_id, BASE):
            return BASE
        if not isinstance(model, str):
            raise _bad("model", f"`model` must be a string, got {_show(model)}.")
        if model in self.engine.adapters():
            return model
        raise not_found(model)

    def encode(self, text: str, special: bool = True) -> list[int]:
        with self.encode_lock:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def check_ids(self, ids, param: str) -> list[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _bad(param, f"`{param}` token ids must be integers.")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise _bad(param, f"Token ids {bad[:5]} are outside the vocabulary (0..{self.vocab - 1}).")
        return ids

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return self.check_ids(prompt, "prompt")
        raise _bad("prompt", "`prompt` must be a string or a list of token ids (one prompt per request).")

    def token_text(self, token: int) -> str:
        """A token's own text (logprobs), as vLLM shows it."""
        return self.tokenizer.decode([token])

    def chat_messages(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "`messages` must be a non-empty list of {role, content} objects.")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad("messages", f"messages[{i}] must be an object with a string `role`.")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported.", param="messages",
                                   code="unsupported_parameter")
                content = "".join(p["text"] for p in content)
            if content is not None and not isinstance(content, str):
                raise _bad("messages", f"messages[{i}].content must be a string or a list of text parts.")
            plain.append({"role": m["role"], "content": content or ""})
        return plain

    def chat_prompt(self, body: dict, sampling: Sampling) -> list[int]:
        plain = self.chat_messages(body)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "This model's tokenizer has no chat template; use /v1/completions.",
                           param="messages", code="no_chat_template")
        try:
            with self.encode_lock:
                text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=sampling.add_generation_prompt,
                                                          continue_final_message=sampling.continue_final,
                                                          tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            raise ApiError(400, "This model's chat template refused these messages (for example, roles in an order "
                           "it does not accept).", param="messages", code="invalid_value", cause=e) from e
        return self.encode(text, special=False)

    def echo_text(self, body: dict, prompt: list[int], sampling: Sampling, chat: bool) -> str:
        """What ``echo`` puts before each choice's text: the prompt (completions); in a chat, the last
        message's content when the answer is in its role (vLLM's rule: the assistant's unless
        add_generation_prompt is false)."""
        if not sampling.echo:
            return ""
        if not chat:
            return body["prompt"] if isinstance(body["prompt"], str) else self.tokenizer.decode(prompt)
        last = self.chat_messages(body)[-1]
        role = "assistant" if sampling.add_generation_prompt else last["role"]
        return last["content"] if last["role"] == role else ""

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can get (the default max_tokens of a chat)."""
        return max(self.engine.max_request_tokens - prompt_len, 1)

    async def submit(self, body: dict, adapter: str, sampling: Sampling, chat: bool) -> Completion:
        """Submit the request's ``n`` choices (each its own engine request; seeded choice i samples
        with seed + i, as vLLM's). Refused (4xx) before any is submitted, or with all cancelled."""
        def prepare():  # tokenizing a long prompt and checking its ids take seconds: not on the event loop
            prompt = self.chat_prompt(body, sampling) if chat else self.completion_prompt(body)
            return prompt, self.echo_text(body, prompt, sampling, chat)

        prompt, prefix = await run_in_threadpool(prepare)
        self.check_ids(sampling.stop_token_ids, "stop_token_ids")
        max_tokens = sampling.max_tokens or (self.room(len(prompt)) if chat else COMPLETION_DEFAULT_MAX_TOKENS)
        if sampling.min_tokens > max_tokens:
            raise _bad("min_tokens", f"`min_tokens` ({sampling.min_tokens}) is more than max_tokens ({max_tokens}).")
        eos = [] if sampling.ignore_eos else self.engine.eos_ids
        stops = Stops(sampling.stop, sampling.min_tokens, sampling.include_stop, eos + sampling.stop_token_ids)
        completion = Completion(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", body.get("model") or
                                self.model_id, len(prompt))
        try:
            for i in range(sampling.n):
                seed = None if sampling.seed is None else sampling.seed + i
                request = sampling.request(prompt, adapter, max_tokens, seed,
                                           StopWatch(self.tokenizer, stops) if sampling.stop else None)
                if i == 0:
                    await run_in_threadpool(self.engine.validate, request)
                self.check_alive()
                completion.jobs.append(Job(self, request, stops, i, completion.queue, prefix,
                                           sampling.token_ids_as_text))
        except BaseException as e:
            completion.close()
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), type="server_error", code="queue_full") from e
            if isinstance(e, NotRunning):  # stopped meanwhile
                raise self.unavailable() from e
            if isinstance(e, UnknownAdapter):  # unloaded meanwhile
                raise not_found(adapter) from e
            if isinstance(e, ValueError):  # the engine's own words for what is wrong with the request
                code = "context_length_exceeded" if isinstance(e, PromptTooLong) else "invalid_value"
                raise ApiError(400, str(e), param="messages" if chat else "prompt", code=code) from e
            raise
        self.metrics.prompt_tokens.inc(len(prompt) * sampling.n)
        return completion

    def failure(self, completion: Completion, request_id: str) -> ApiError | None:
        """Why a finished request has no answer, or None: a choice failed in the engine (500; the log
        has the engine's error), or the engine stopped under it (503: the server is shutting down; a
        request its client left is cancelled too, but then nobody asks)."""
        reasons = [job.handle.finish_reason for job in completion.jobs]
        if "error" in reasons:
            for job in completion.jobs:
                if job.handle.error:
                    logger.error("request %s failed in the engine: %s", request_id, job.handle.error)
            return ApiError(500, f"The request failed in the engine (request id {request_id}); the server's log has "
                            "the details.", type="server_error", code="engine_error")
        if "cancelled" in reasons:
            return self.unavailable()
        return None

    # responses

    def choice(self, job: Job, kind: str, text: str, finish_reason, chunk: bool, first: bool = False) -> dict:
        logprobs = job.logprobs(kind == "chat")
        if kind != "chat":
            return {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if not chunk:
            return {"index": job.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": job.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, completion: Completion, kind: str, choices: list, chunk: bool) -> dict:
        obj = {"id": completion.id, "created": completion.created, "model": completion.model_name}
        obj["object"] = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" else "text_completion"
        obj["choices"] = choices
        return obj

    async def complete(self, request, kind: str):
        request_id = request.state.request_id
        body = await json_body(request, self.max_body_bytes)
        chat = kind == "chat"
        sampling = Sampling(body, chat)
        adapter = self.adapter_for(body.get("model"))
        completion = await self.submit(body, adapter, sampling, chat)
        if sampling.stream:
            return JobStream(completion, self.events(completion, kind, sampling, request_id))
        try:
            await completion.collect(request)
            error = self.failure(completion, request_id)
            if error:
                raise error
            choices = [self.choice(job, kind, job.text.text, job.finish_reason, chunk=False) for job in completion.jobs]
            obj = self.response(completion, kind, choices, chunk=False)
            obj["usage"] = completion.usage()
            return JSONResponse(obj)
        except ClientGone:
            logger.info("client went away; request %s cancelled", completion.id)
            return JSONResponse({}, status_code=499)
        finally:
            completion.close()

    async def events(self, completion: Completion, kind: str, sampling: Sampling, request_id: str):
        """Server-sent events in OpenAI's chunk format, then ``data: [DONE]``; a request that fails
        ends with an error event first. Leaving early (the client disconnected: the task is
        cancelled, or the generator closed) cancels the request. With continuous_usage_stats every
        chunk carries the usage so far."""
        def sse(choices, usage=False) -> str:
            obj = self.response(completion, kind, choices, chunk=True)
            if usage or sampling.continuous_usage:
                obj["usage"] = completion.usage()
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if kind == "chat":
                for job in completion.jobs:
                    yield sse([self.choice(job, kind, "", None, chunk=True, first=True)])
            async for job, chunk in completion.chunks():
                delta = job.text.add(chunk)
                if delta or (job.handle.request.logprobs is not None and job.logprobs_sent < job.text.completion_tokens):
                    yield sse([self.choice(job, kind, delta, None, chunk=True)])
            error = self.failure(completion, request_id)
            if error:
                yield f"data: {json.dumps(error.body())}\n\n"
            else:
                for job in completion.jobs:
                    yield sse([self.choice(job, kind, job.text.finish(), job.finish_reason, chunk=True)])
                if sampling.include_usage:
                    yield sse([], usage=True)
        except Exception:  # noqa: BLE001 - the response has started: the client gets an error event, the log the rest
            logger.exception("request %s failed while streaming", request_id)
            yield f"data: {json.dumps(internal_error(request_id).body())}\n\n"
        finally:
            completion.close()
        yield "data: [DONE]\n\n"

    def models(self) -> dict:
        entry = dict(object="model", created=self.created, owned_by="hf_invisiblelora")
        data = [dict(entry, id=self.model_id, root=self.root or self.model_id, parent=None)]
        data += [dict(entry, id=name, root=self.adapter_paths.get(name), parent=self.model_id)
                 for name in self.engine.adapters()]
        return {"object": "list", "data": data}

    def check_runtime_updates(self) -> None:
        if not self.runtime_updates:
            raise ApiError(404, "Loading and unloading adapters while serving is off on this server (the operator "
                           "can start it with --allow-runtime-lora-updating).", code="not_found")

    def adapter_folder(self, path: str) -> str:
        """The folder ``lora_path`` names, symlinks and ``..`` resolved. Refused (403) outside every
        --lora-root, whether it exists or not; then (400) unless it is a local PEFT adapter folder,
        checked here because PEFT takes a path it does not find for a Hub repo id and downloads it."""
        if "\x00" in path:
            raise _bad("lora_path", "`lora_path` must not contain NUL characters.")
        folder = os.path.realpath(os.path.expanduser(path))
        if self.lora_roots and not any(os.path.commonpath([folder, root]) == root for root in self.lora_roots):
            raise ApiError(403, "`lora_path` is outside the folders this server loads adapters from (--lora-root).",
                           param="lora_path", code="lora_path_not_allowed")
        problem = missing("`lora_path`", folder, "adapter_config.json", "a PEFT adapter folder")
        if problem:
            raise ApiError(400, f"{problem}.", param="lora_path", code="adapter_load_failed")
        return folder

    async def load_adapter(self, request):
        self.check_runtime_updates()
        body = await json_body(request, self.max_body_bytes)
        name, path = body.get("lora_name"), body.get("lora_path")
        for key, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise _bad(key, f"`{key}` must be a non-empty string.")
        folder = self.adapter_folder(path)
        self.check_alive()
        # Checked and taken with no await in between, so atomic on the event loop: of two loads under
        # one new name, the second gets adapter_exists here (and the engine's AdapterExists backs it up).
        exists = ApiError(400, f"The name {_show(name)} is already in use (an adapter or the base model).",
                          param="lora_name", code="adapter_exists")
        if name in (self.model_id, BASE) or name in self.adapter_paths:
            raise exists
        self.adapter_paths[name] = path
        try:  # the engine refuses what it cannot serve (checks.check_model) and rolls back a failed load
            await run_in_threadpool(self.engine.load_adapter, name, folder)
        except Exception as e:  # noqa: BLE001 - PEFT's errors for a bad folder are of many kinds
            del self.adapter_paths[name]
            if isinstance(e, NotRunning):
                raise self.unavailable() from e
            if isinstance(e, AdapterExists):
                raise exists from e
            if isinstance(e, AdapterUnsupported):  # its message is ours: what cannot be served, and why
                raise ApiError(400, f"This server cannot serve the adapter: {e}", param="lora_path",
                               code="adapter_unsupported") from e
            raise ApiError(400, "Could not load the PEFT adapter in `lora_path` onto this base model (its files are "
                           "incomplete, or made for another model).", param="lora_path", code="adapter_load_failed",
                           cause=e) from e
        logger.info("loaded adapter %r from %s", name, folder)
        return {"object": "lora_adapter", "id": name, "status": "loaded"}

    async def unload_adapter(self, request):
        self.check_runtime_updates()
        body = await json_body(request, self.max_body_bytes)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.engine.adapters():
            raise ApiError(404, f"No adapter named {_show(name)} is loaded.", param="lora_name", code="model_not_found")
        self.check_alive()
        try:
            await run_in_threadpool(self.engine.unload_adapter, name)
        except AdapterBusy as e:  # in use, or the last one (a PEFT model keeps one)
            raise ApiError(409, str(e), param="lora_name",
                           code="last_adapter" if isinstance(e, LastAdapter) else "adapter_in_use") from e
        except UnknownAdapter as e:  # unloaded meanwhile
            raise ApiError(404, str(e), param="lora_name", code="model_not_found") from e
        except NotRunning as e:
            raise self.unavailable() from e
        self.adapter_paths.pop(name, None)
        logger.info("unloaded adapter %r", name)
        return {"object": "lora_adapter", "id": name, "status": "unloaded"}

    def health(self) -> tuple[dict, int]:
        ok = self.alive()
        return ({"status": "ok" if ok else "engine stopped", "model": self.model_id, "adapters": self.engine.adapters(),
                 "queue_length": self.engine.queue_length(), "running_rows": self.engine.running(),
                 "in_flight": len(self.in_flight)}, 200 if ok else 503)


class JobStream(StreamingResponse):
    """The streaming response of a completion: whatever ends it (the last event, a client that went
    away, a server shutting down) closes its jobs, also when the event generator never started."""

    def __init__(self, completion: Completion, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.completion = completion

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.completion.close()


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
          "/health", "/metrics")


class FrontDoor:
    """ASGI middleware every HTTP request passes (a plain ASGI wrapper: Starlette's
    BaseHTTPMiddleware would get in the way of streaming and disconnects): it gives the request an
    id (``request.state.request_id``, the ``X-Request-Id`` response header), counts the responses
    by endpoint and status, counts the requests being answered (``server.active``, which the drain
    waits for) and, once the server drains, answers 503."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message).append(REQUEST_ID, request_id)
                self.server.metrics.http.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if self.server.draining:
            error = shutting_down()
            return await JSONResponse(error.body(), error.status, error.headers)(scope, receive, send_with_id)
        self.server.active += 1
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if not started:  # the 500 of the error handler goes out past this wrapper: count it here
                self.server.metrics.http.labels(endpoint, "500").inc()
            raise
        finally:
            self.server.active -= 1


def require_key(key: str):
    """A dependency refusing (401) a request without ``Authorization: Bearer <key>``."""
    bearer = HTTPBearer(auto_error=False)
    expected = key.encode()

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)):
        given = credentials.credentials.encode() if credentials else b""
        if not secrets.compare_digest(given, expected):  # in constant time: no timing hints of the key
            raise ApiError(401, "Missing or wrong API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return check


def build_app(server: Server, stop_engine_on_shutdown: bool = False):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if stop_engine_on_shutdown:
            server.engine.stop()

    app = FastAPI(title="hf_invisiblelora", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        if e.cause is not None:
            logger.warning("request %s: %s", request.state.request_id, e.message, exc_info=e.cause)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        request_id = request.state.request_id
        logger.error("request %s failed", request_id, exc_info=e)
        return JSONResponse(internal_error(request_id).body(), status_code=500, headers={REQUEST_ID: request_id})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key(server.api_key))] if server.api_key else [])

    @v1.post("/completions")
    async def completions(request: Request):
        return await server.complete(request, "completion")

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await server.complete(request, "chat")

    @v1.get("/models")
    async def models():
        return server.models()

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        for entry in server.models()["data"]:
            if entry["id"] == model_id:
                return entry
        raise not_found(model_id)

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await server.load_adapter(request)

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await server.unload_adapter(request)

    app.include_router(v1)

    @app.get("/health")
    async def health():
        body, status = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        data, content_type = server.metrics.render()
        return Response(data, media_type=content_type)

    app.add_middleware(FrontDoor, server=server)
    return app


class Graceful(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown. On the first SIGTERM (or SIGINT) new
    requests get 503 (FrontDoor) while those in flight finish, for up to ``timeout`` seconds; then
    the engine stops, which ends what still runs (a stream with an error event and ``[DONE]``, a
    waiting call with 503), and uvicorn shuts down (its graceful shutdown lets those last
    responses go out; the lifespan's end stops the engine, already stopped). A second signal is
    uvicorn's own: its shutdown starts at once."""

    def __init__(self, config: uvicorn.Config, server: Server, timeout: float):
        super().__init__(config)
        self.app_server, self.timeout = server, timeout
        self.loop = self.drain_task = None

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if self.app_server.draining:
            return super().handle_exit(sig, frame)
        self.app_server.draining = True
        # A signal handler runs between two steps of the event loop's thread: the drain starts as a task of its own.
        self.loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self):
        self.drain_task = self.loop.create_task(self.drain())  # held: the loop keeps only weak references

    async def drain(self):
        server = self.app_server
        deadline = self.loop.time() + self.timeout
        logger.info("shutting down: new requests get 503; %d in flight have %g s to finish", server.active,
                    self.timeout)
        try:
            while server.active and self.loop.time() < deadline:
                await asyncio.sleep(0.05)
            if server.active:
                logger.warning("ending %d request(s) still running after %g s", server.active, self.timeout)
            await run_in_threadpool(server.engine.stop)
        finally:  # whatever happens, uvicorn shuts down
            self.should_exit = True


# --- loading and the command line ---


def load_model(path: str, loras: list[tuple[str, str]], dtype: str = "float32"):
    """(PeftModel in eval mode with every adapter loaded, tokenizer) from a base model folder."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not loras:
        raise SystemExit("error: give at least one --lora NAME=PATH (more can be loaded while serving)")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    (first, first_path), rest = loras[0], loras[1:]
    model = PeftModel.from_pretrained(base, first_path, adapter_name=first)
    for name, adapter_path in rest:
        model.load_adapter(adapter_path, adapter_name=name)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def load_zoo_model(name: str, adapters: list[str] | None, dtype: str):
    """(model, tokenizer, base model folder, {adapter: its folder}): the zoo's base model with its
    adapters (``adapters``; default: every built one, or the demo's four, trained first, when none
    is built)."""
    import torch

    from . import zoo
    from .zoo.demo import DEMO_ADAPTERS

    if not adapters:
        manifest = zoo.read_manifest(zoo.zoo_dir(name))
        adapters = [n for n in manifest["adapters"] if zoo.is_built(zoo.zoo_dir(name), n, manifest)]
        adapters = adapters or (DEMO_ADAPTERS if name == "smollm2" else None)
    zoo.build(name, only=adapters)  # a no-op when they are built
    model, tokenizer, names = zoo.load_zoo(name, adapters, dtype=getattr(torch, dtype))
    return model, tokenizer, str(zoo.assets.prepare(name)), {n: str(zoo.zoo_dir(name) / n) for n in names}


def missing(option: str, path: str, needed: str, what: str) -> str | None:
    """Why ``path`` (given as ``option``, which names it) is not the local folder it must be
    (``what``, holding the file ``needed``), or None. Checked before loading: PEFT and Transformers
    would take a missing folder for a Hub repo id."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return f"{option} is not a folder"
    if not os.path.isfile(os.path.join(folder, needed)):
        return f"{option} has no {needed} ({what})"
    return None


def parse_lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_invisiblelora.serve", description=__doc__.split("\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="base model folder (AutoModelForCausalLM.from_pretrained)")
    source.add_argument("--zoo", choices=("smollm2", "gemma3"), help="serve a zoo base model and its adapters")
    p.add_argument("--lora", action="append", type=parse_lora, default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA adapter folder served as model NAME (repeatable)")
    p.add_argument("--adapters", nargs="+", help="with --zoo: the zoo adapters to serve (default: every built one)")
    p.add_argument("--served-model-name", help="the base model's id in the API (default: --model as given, or the zoo name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together")
    p.add_argument("--max-len", type=int, default=1024, help="cache slots per row: prompt + max_tokens + drafts + 1")
    p.add_argument("--max-queue", type=int, default=1024, help="requests waiting for a row before 429")
    p.add_argument("--max-loras", type=int, help="the most distinct adapters in one pass (default: no bound)")
    p.add_argument("--max-cpu-loras", type=int,
                   help="the most adapters kept loaded; idle ones are evicted LRU and loaded again on demand "
                        "(default: no bound)")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="the most tokens drafted per cycle (K)")
    p.add_argument("--gate", default="auto", choices=("auto", "always", "never"))
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: OMP_NUM_THREADS, else the free CPUs)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on every /v1 endpoint (default: ${API_KEY_ENV}; "
                        "unset: no key)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true"),
                   help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (or ${RUNTIME_LORA_ENV}=1)")
    p.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="runtime loading reads adapters from inside these folders only (repeatable; none: anywhere)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="the largest request body (413 above)")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT,
                   help="on SIGTERM, seconds for the requests in flight to finish before they are ended")
    args = p.parse_args(argv)
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable()
                                         and args.api_key.strip() == args.api_key != ""):
        p.error("the API key must be printable ASCII, without spaces around it (an HTTP header carries it)")
    if args.max_body_bytes < 1 or args.shutdown_timeout < 0:
        p.error("--max-body-bytes must be >= 1 and --shutdown-timeout >= 0")
    if any(v is not None and v < 1 for v in (args.max_loras, args.max_cpu_loras)):
        p.error("--max-loras and --max-cpu-loras must be >= 1")

    import torch

    import hf_invisiblelora  # noqa: F401

    from .engine import Engine
    from .threads import set_threads

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problems = [missing(f"--lora {name}={path}", path, "adapter_config.json", "a PEFT adapter folder")
                for name, path in args.lora]
    if args.model:
        problems.insert(0, missing(f"--model {args.model}", args.model, "config.json", "a Transformers model folder"))
    problems += [f"--lora-root {root} is not a folder" for root in args.lora_root if not os.path.isdir(root)]
    if any(problems):
        print(f"error: {next(p for p in problems if p)}", file=sys.stderr)
        return 2
    logger.info(set_threads(args.threads))
    if args.zoo:
        from .zoo import AssetUnavailable
        from .zoo.assets import EXIT_UNAVAILABLE

        try:
            model, tokenizer, root, adapter_paths = load_zoo_model(args.zoo, args.adapters, args.dtype)
        except AssetUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        for name, path in args.lora:
            model.load_adapter(path, adapter_name=name)
        model_id = args.served_model_name or args.zoo
    else:  # with --max-cpu-loras, the first ones loaded; the others when a request names them
        model, tokenizer = load_model(args.model, args.lora[: args.max_cpu_loras], args.dtype)
        model_id, root, adapter_paths = args.served_model_name or args.model, args.model, {}
    adapter_paths.update(args.lora)
    for name in list(model.peft_config)[args.max_cpu_loras or len(model.peft_config):]:
        model.delete_adapter(name)  # more zoo adapters than --max-cpu-loras: loaded again on demand
    if model_id in model.peft_config:
        raise SystemExit(f"error: an adapter is named like the base model ({model_id!r}); use --served-model-name")
    engine = Engine(model, max_batch=args.max_batch, max_len=args.max_len, num_draft_tokens=args.num_draft_tokens,
                    gate=args.gate, max_queue=args.max_queue, max_loras=args.max_loras,
                    max_cpu_loras=args.max_cpu_loras, adapter_paths=adapter_paths).start()
    lora_roots = [os.path.realpath(root) for root in args.lora_root]
    server = Server(engine, tokenizer, model_id, root, adapter_paths, api_key=args.api_key,
                    runtime_updates=args.allow_runtime_lora_updating, lora_roots=lora_roots,
                    max_body_bytes=args.max_body_bytes)
    logger.info("serving %s with adapters %s on http://%s:%d; %s; runtime adapter loading %s", model_id,
                engine.adapters(), args.host, args.port, "API key required" if args.api_key else "no API key",
                f"on, from {lora_roots or 'any folder'}" if args.allow_runtime_lora_updating else "off")
    # The drain (Graceful) has ended every request when uvicorn's own graceful shutdown starts: its
    # timeout only bounds sending the last responses.
    config = uvicorn.Config(build_app(server, stop_engine_on_shutdown=True), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=5)
    Graceful(config, server, args.shutdown_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
