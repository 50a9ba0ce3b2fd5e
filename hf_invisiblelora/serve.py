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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from .checks import BASE
from .engine import AdapterBusy, LastAdapter, NotRunning, PromptTooLong, QueueFull, UnknownAdapter

logger = logging.getLogger("hf_invisiblelora.serve")

DTYPES = ("float32", "float64", "bfloat16", "float16")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16


# --- errors ---


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_unavailable() -> ApiError:
    return ApiError(503, "The decoding engine is not running (see the server's log).", type="server_error",
                    code="engine_unavailable")


def not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


# --- request parameters ---


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _number(body: dict, name: str, default, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise _bad(name, f"`{name}` must be {'an integer' if integer else 'a number'}, got {value!r}.")
    if not integer:
        value = float(value)  # Transformers' warpers want floats
        if not math.isfinite(value):
            raise _bad(name, f"`{name}` must be finite, got {value!r}.")
    return value


def _unsupported(body: dict, name: str, allowed=(None,)) -> None:
    if body.get(name) not in allowed:
        raise ApiError(400, f"`{name}` is not supported by this server (got {body[name]!r}).", param=name,
                       code="unsupported_parameter")


class Sampling:
    """The sampling fields of a completion or chat request, validated."""

    def __init__(self, body: dict, chat: bool):
        n = _number(body, "n", 1, integer=True)
        if n != 1:
            raise ApiError(400, f"Only n=1 is supported, got n={n}.", param="n", code="unsupported_parameter")
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
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        self.max_tokens = None
        for name in names:
            value = _number(body, name, None, integer=True)
            if value is not None and value < 1:
                raise _bad(name, f"`{name}` must be >= 1, got {value}.")
            self.max_tokens = self.max_tokens or value
        self.seed = _number(body, "seed", None, integer=True)  # its range: the engine's check
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", "`stop` must be a non-empty string or a list of them.")
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"At most {MAX_STOP_STRINGS} stop strings, got {len(stop)}.")
        self.stop = stop
        self.stream = body.get("stream") or False
        if not isinstance(self.stream, bool):
            raise _bad("stream", f"`stream` must be a boolean, got {self.stream!r}.")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or (options and not self.stream):
            raise _bad("stream_options", "`stream_options` must be an object, and only given with stream=true.")
        self.include_usage = bool(options.get("include_usage"))
        for name in ("presence_penalty", "frequency_penalty"):
            _unsupported(body, name, (None, 0, 0.0))
        _unsupported(body, "logit_bias", (None, {}))
        for name in ("tools", "functions", "tool_choice", "function_call"):
            _unsupported(body, name, (None, [], "none"))
        if chat:
            _unsupported(body, "logprobs", (None, False))
            _unsupported(body, "top_logprobs", (None, 0))
            fmt = body.get("response_format")
            if fmt is not None and fmt != {"type": "text"}:
                raise ApiError(400, "`response_format` other than text is not supported.", param="response_format",
                               code="unsupported_parameter")
        else:
            _unsupported(body, "logprobs", (None, 0))
            _unsupported(body, "echo", (None, False))
            _unsupported(body, "best_of", (None, 1))
            _unsupported(body, "suffix", (None, ""))


def find_stop(text: str, stops) -> int | None:
    """Where the first stop string starts in ``text`` (None: none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


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
    emitted half (an incomplete one decodes as U+FFFD and is held back until it completes). With
    stop strings, the text is cut at the first stop string (not included, as in OpenAI's API) and
    a tail that could start one is held back until it is known not to."""

    def __init__(self, tokenizer, stops=()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.tokens: list[int] = []
        self.text = ""
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
        text = self._decode(self.tokens)
        cut = find_stop(text, self.stops) if self.stops else None
        if cut is None:
            self.text, self.completion_tokens = text, len(self.tokens)
            safe = len(text.rstrip("\ufffd"))
            safe -= held_tail(text[:safe], self.stops)
        else:
            self.stopped, self.text, safe = True, text[:cut], cut
            self.completion_tokens = next(
                (i for i in range(before + 1, len(self.tokens) + 1)
                 if find_stop(self._decode(self.tokens[:i]), self.stops) is not None), len(self.tokens))
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
    occurs in the decoded text, which ends the request at that cycle. Never raises (an exception
    there would stop the engine): on an error it ends the request."""

    def __init__(self, tokenizer, stops):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []

    def __call__(self, tokens: list[int]) -> bool:
        try:
            self.tokens += tokens
            return find_stop(self.tokenizer.decode(self.tokens, skip_special_tokens=True), self.stops) is not None
        except Exception:  # noqa: BLE001
            logger.exception("stop-string check failed; ending the request")
            return True


# --- the bridge from the engine's thread to asyncio ---


class ClientGone(Exception):
    pass


class Job:
    """One submitted request: a thread iterates the engine's handle and hands each chunk to the
    event loop; ``chunks()`` yields them there. ``close()`` cancels the request if it is not
    finished (a client that went away) and forgets it."""

    def __init__(self, server: "Server", request, stops, id: str, model_name: str):
        self.server, self.id, self.model_name = server, id, model_name
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.text = TextStream(server.tokenizer, stops)
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first_token_s = None
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
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    async def chunks(self):
        """Chunks of committed tokens until the request finishes."""
        while (chunk := await self.queue.get()) is not None:
            if self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.start
                self.server.metrics.ttft.observe(self.first_token_s)
            yield chunk

    async def collect(self, request) -> None:
        """Take every chunk (a non-streaming call); a client that disconnects meanwhile raises ClientGone."""
        async def consume():
            async for chunk in self.chunks():
                self.text.add(chunk)
            self.text.finish()

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

    @property
    def finish_reason(self) -> str:
        return "stop" if self.text.stopped else self.handle.finish_reason

    def usage(self) -> dict:
        prompt = len(self.handle.request.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": self.text.completion_tokens,
                "total_tokens": prompt + self.text.completion_tokens}

    def close(self) -> None:
        if self.handle.finish_reason is None:
            self.handle.cancel()
            reason = "cancelled"
        else:
            reason = self.finish_reason
        if self.server.in_flight.pop(self.handle.request.id, None) is not None:
            self.server.metrics.finished.labels(reason).inc()
            self.server.metrics.latency.observe(time.perf_counter() - self.start)


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


# --- the server ---


class Server:
    """The HTTP side of one engine: request parsing, the bridge, the routes (``app``)."""

    def __init__(self, engine, tokenizer, model_id: str, root: str | None = None):
        self.engine, self.tokenizer, self.model_id, self.root = engine, tokenizer, model_id, root
        self.created = int(time.time())
        self.vocab = engine.inner.get_input_embeddings().num_embeddings
        self.in_flight: dict[int, Job] = {}
        self.metrics = Metrics(engine, model_id)
        self.encode_lock = threading.Lock()

    # helpers

    def alive(self) -> bool:
        return self.engine.alive

    def check_alive(self) -> None:
        if not self.alive():
            raise engine_unavailable()

    def adapter_for(self, model) -> str:
        if model is None or model in (self.model_id, BASE):
            return BASE
        if not isinstance(model, str):
            raise _bad("model", f"`model` must be a string, got {model!r}.")
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

    def chat_prompt(self, body: dict) -> list[int]:
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
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "This model's tokenizer has no chat template; use /v1/completions.",
                           param="messages", code="no_chat_template")
        try:
            with self.encode_lock:
                text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            raise _bad("messages", f"The chat template failed on these messages: {e}") from e
        return self.encode(text, special=False)

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can get (the default max_tokens of a chat)."""
        return max(self.engine.max_request_tokens - prompt_len, 1)

    def submit(self, prompt: list[int], adapter: str, sampling: Sampling, chat: bool, model_name: str) -> Job:
        from .engine import Request  # fastapi's Request is this module's

        self.check_alive()
        max_tokens = sampling.max_tokens or (self.room(len(prompt)) if chat else COMPLETION_DEFAULT_MAX_TOKENS)
        request = Request(prompt, adapter=adapter, max_tokens=max_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                          on_tokens=StopWatch(self.tokenizer, sampling.stop) if sampling.stop else None)
        try:
            job = Job(self, request, sampling.stop, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name)
        except QueueFull as e:
            raise ApiError(429, str(e), type="server_error", code="queue_full") from e
        except UnknownAdapter as e:  # unloaded meanwhile
            raise not_found(adapter) from e
        except ValueError as e:
            code = "context_length_exceeded" if isinstance(e, PromptTooLong) else "invalid_value"
            raise ApiError(400, str(e), param="messages" if chat else "prompt", code=code) from e
        self.metrics.prompt_tokens.inc(len(prompt))
        return job

    # responses

    def completion_object(self, job: Job, kind: str, text: str, finish_reason, chunk: bool, first: bool = False):
        obj = {"id": job.id, "created": job.created, "model": job.model_name}
        if kind == "chat":
            if chunk:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": finish_reason}
            obj["object"] = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj["object"] = "text_completion"
        obj["choices"] = [choice]
        return obj

    async def complete(self, request, kind: str):
        body = await json_body(request)
        chat = kind == "chat"
        sampling = Sampling(body, chat)
        adapter = self.adapter_for(body.get("model"))
        prompt = self.chat_prompt(body) if chat else self.completion_prompt(body)
        job = self.submit(prompt, adapter, sampling, chat, body.get("model") or self.model_id)
        if sampling.stream:
            return JobStream(job, self.events(job, kind, sampling.include_usage))
        try:
            await job.collect(request)
            if job.handle.finish_reason == "error":
                raise ApiError(500, f"The request failed in the engine: {job.handle.error}", type="server_error",
                               code="engine_error")
            obj = self.completion_object(job, kind, job.text.text, job.finish_reason, chunk=False)
            obj["usage"] = job.usage()
            return JSONResponse(obj)
        except ClientGone:
            logger.info("client went away; request %s cancelled", job.handle.request.id)
            return JSONResponse({}, status_code=499)
        finally:
            job.close()

    async def events(self, job: Job, kind: str, include_usage: bool):
        """Server-sent events in OpenAI's chunk format, then ``data: [DONE]``. Leaving early (the
        client disconnected: the task is cancelled, or the generator closed) cancels the request."""
        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if kind == "chat":
                yield sse(self.completion_object(job, kind, "", None, chunk=True, first=True))
            async for chunk in job.chunks():
                delta = job.text.add(chunk)
                if delta:
                    yield sse(self.completion_object(job, kind, delta, None, chunk=True))
            if job.handle.finish_reason == "error":
                error = ApiError(500, f"The request failed in the engine: {job.handle.error}", type="server_error",
                                 code="engine_error")
                yield sse(error.body())
            else:
                last = self.completion_object(job, kind, job.text.finish(), job.finish_reason, chunk=True)
                yield sse(last)
                if include_usage:
                    usage = self.completion_object(job, kind, "", None, chunk=True)
                    usage["choices"], usage["usage"] = [], job.usage()
                    yield sse(usage)
            yield "data: [DONE]\n\n"
        finally:
            job.close()

    def models(self) -> dict:
        entry = dict(object="model", created=self.created, owned_by="hf_invisiblelora")
        data = [dict(entry, id=self.model_id, root=self.root or self.model_id, parent=None)]
        data += [dict(entry, id=name, root=self.root or self.model_id, parent=self.model_id)
                 for name in self.engine.adapters()]
        return {"object": "list", "data": data}

    async def load_adapter(self, request):
        body = await json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        for key, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise _bad(key, f"`{key}` must be a non-empty string.")
        if name in (self.model_id, BASE) or name in self.engine.adapters():
            raise ApiError(400, f"The name {name!r} is already in use (an adapter or the base model).",
                           param="lora_name", code="adapter_exists")
        self.check_alive()
        try:  # the engine refuses what it cannot serve (checks.check_model) and rolls back a failed load
            await run_in_threadpool(self.engine.load_adapter, name, path)
        except NotRunning as e:
            raise engine_unavailable() from e
        except ValueError as e:
            raise ApiError(400, f"This server cannot serve the adapter at {path!r}: {e}", param="lora_path",
                           code="adapter_unsupported") from e
        except Exception as e:  # noqa: BLE001 - PEFT's errors for a bad folder are of many kinds
            raise ApiError(400, f"Could not load the adapter from {path!r}: {type(e).__name__}: {e}",
                           param="lora_path", code="adapter_load_failed") from e
        logger.info("loaded adapter %r from %s", name, path)
        return {"object": "lora_adapter", "id": name, "status": "loaded"}

    async def unload_adapter(self, request):
        body = await json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.engine.adapters():
            raise ApiError(404, f"No adapter named {name!r} is loaded.", param="lora_name", code="model_not_found")
        self.check_alive()
        try:
            await run_in_threadpool(self.engine.unload_adapter, name)
        except AdapterBusy as e:  # in use, or the last one (a PEFT model keeps one)
            raise ApiError(409, str(e), param="lora_name",
                           code="last_adapter" if isinstance(e, LastAdapter) else "adapter_in_use") from e
        except UnknownAdapter as e:  # unloaded meanwhile
            raise ApiError(404, str(e), param="lora_name", code="model_not_found") from e
        except NotRunning as e:
            raise engine_unavailable() from e
        logger.info("unloaded adapter %r", name)
        return {"object": "lora_adapter", "id": name, "status": "unloaded"}

    def health(self) -> tuple[dict, int]:
        ok = self.alive()
        return ({"status": "ok" if ok else "engine stopped", "model": self.model_id, "adapters": self.engine.adapters(),
                 "queue_length": self.engine.queue_length(), "running_rows": self.engine.running(),
                 "in_flight": len(self.in_flight)}, 200 if ok else 503)


class JobStream(StreamingResponse):
    """The streaming response of a job: whatever ends it (the last event, a client that went away,
    a server shutting down) closes the job, also when the event generator never started."""

    def __init__(self, job: Job, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


async def json_body(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
          "/health", "/metrics")


class CountRequests:
    """ASGI middleware counting HTTP responses by endpoint and status (a plain ASGI wrapper:
    Starlette's BaseHTTPMiddleware would get in the way of streaming and disconnects)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def build_app(server: Server, stop_engine_on_shutdown: bool = False):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if stop_engine_on_shutdown:
            server.engine.stop()

    app = FastAPI(title="hf_invisiblelora", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        logger.exception("unexpected error")
        error = ApiError(500, f"Internal error: {type(e).__name__}: {e}", type="server_error", code="internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.complete(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.complete(request, "chat")

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        for entry in server.models()["data"]:
            if entry["id"] == model_id:
                return entry
        raise not_found(model_id)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await server.load_adapter(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await server.unload_adapter(request)

    @app.get("/health")
    async def health():
        body, status = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        data, content_type = server.metrics.render()
        return Response(data, media_type=content_type)

    app.add_middleware(CountRequests, counter=server.metrics.http)
    return app


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
    """The zoo's base model with its adapters (``adapters``; default: every built one, or the
    demo's four, trained first, when none is built)."""
    import torch

    from . import zoo
    from .zoo.demo import DEMO_ADAPTERS

    if not adapters:
        manifest = zoo.read_manifest(zoo.zoo_dir(name))
        adapters = [n for n in manifest["adapters"] if zoo.is_built(zoo.zoo_dir(name), n, manifest)]
        adapters = adapters or (DEMO_ADAPTERS if name == "smollm2" else None)
    zoo.build(name, only=adapters)  # a no-op when they are built
    model, tokenizer, names = zoo.load_zoo(name, adapters, dtype=getattr(torch, dtype))
    return model, tokenizer, str(zoo.assets.prepare(name))


def missing(option: str, path: str, needed: str, what: str) -> str | None:
    """Why ``path`` (given as ``option``) is not the local folder it must be (``what``, holding the
    file ``needed``), or None. Checked before loading: PEFT and Transformers would take a missing
    folder for a Hub repo id."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return f"{option}: {path} is not a folder"
    if not os.path.isfile(os.path.join(folder, needed)):
        return f"{option}: {path} has no {needed} ({what})"
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
    p.add_argument("--num-draft-tokens", type=int, default=4, help="the most tokens drafted per cycle (K)")
    p.add_argument("--gate", default="auto", choices=("auto", "always", "never"))
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: OMP_NUM_THREADS, else the free CPUs)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = p.parse_args(argv)

    import torch
    import uvicorn

    import hf_invisiblelora  # noqa: F401

    from .engine import Engine
    from .threads import set_threads

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problems = [missing(f"--lora {name}={path}", path, "adapter_config.json", "a PEFT adapter folder")
                for name, path in args.lora]
    if args.model:
        problems.insert(0, missing("--model", args.model, "config.json", "a Transformers model folder"))
    if any(problems):
        print(f"error: {next(p for p in problems if p)}", file=sys.stderr)
        return 2
    logger.info(set_threads(args.threads))
    if args.zoo:
        from .zoo import AssetUnavailable
        from .zoo.assets import EXIT_UNAVAILABLE

        try:
            model, tokenizer, root = load_zoo_model(args.zoo, args.adapters, args.dtype)
        except AssetUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        for name, path in args.lora:
            model.load_adapter(path, adapter_name=name)
        model_id = args.served_model_name or args.zoo
    else:
        model, tokenizer = load_model(args.model, args.lora, args.dtype)
        model_id, root = args.served_model_name or args.model, args.model
    if model_id in model.peft_config:
        raise SystemExit(f"error: an adapter is named like the base model ({model_id!r}); use --served-model-name")
    engine = Engine(model, max_batch=args.max_batch, max_len=args.max_len, num_draft_tokens=args.num_draft_tokens,
                    gate=args.gate, max_queue=args.max_queue).start()
    server = Server(engine, tokenizer, model_id, root)
    logger.info("serving %s with adapters %s on http://%s:%d", model_id, engine.adapters(), args.host, args.port)
    uvicorn.run(build_app(server, stop_engine_on_shutdown=True), host=args.host, port=args.port,
                log_level=args.log_level, timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
