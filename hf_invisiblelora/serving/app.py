"""The HTTP side of one engine: the Server (parsing, submitting, responding), the middleware every
request passes, and the FastAPI app with its routes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
import uuid

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException

from ..checks import BASE
from ..engine import (
    AdapterBusy,
    AdapterExists,
    AdapterUnsupported,
    LastAdapter,
    NotRunning,
    PromptTooLong,
    QueueFull,
    UnknownAdapter,
)
from .bridge import ClientGone, Completion, Job
from .metrics import Metrics
from .protocol import MAX_BODY_BYTES, ApiError, Sampling, bad, internal_error, json_body, not_found, shutting_down, show
from .text import Stops

logger = logging.getLogger("hf_invisiblelora.serve")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REQUEST_ID = "X-Request-Id"


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
            raise bad("model", f"`model` must be a string, got {show(model)}.")
        if model in self.engine.adapters():
            return model
        raise not_found(model)

    def encode(self, text: str, special: bool = True) -> list[int]:
        with self.encode_lock:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt  # their range: Engine.validate
        raise bad("prompt", "`prompt` must be a string or a list of token ids (one prompt per request).")

    def token_text(self, token: int) -> str:
        """A token's own text (logprobs), as vLLM shows it."""
        return self.tokenizer.decode([token])

    def chat_messages(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "`messages` must be a non-empty list of {role, content} objects.")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad("messages", f"messages[{i}] must be an object with a string `role`.")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported.", param="messages",
                                   code="unsupported_parameter")
                content = "".join(p["text"] for p in content)
            if content is not None and not isinstance(content, str):
                raise bad("messages", f"messages[{i}].content must be a string or a list of text parts.")
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
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            max_tokens = self.room(len(prompt)) if chat else COMPLETION_DEFAULT_MAX_TOKENS
        if sampling.min_tokens > max_tokens:
            raise bad("min_tokens", f"`min_tokens` ({sampling.min_tokens}) is more than max_tokens ({max_tokens}).")
        stops = Stops(sampling.stop, sampling.min_tokens, sampling.include_stop,
                      self.engine.stop_ids(sampling.ignore_eos, sampling.stop_token_ids))
        completion = Completion(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", body.get("model") or
                                self.model_id, len(prompt))
        try:
            for i in range(sampling.n):
                seed = None if sampling.seed is None else sampling.seed + i
                request = sampling.request(prompt, adapter, max_tokens, seed)
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
                param = getattr(e, "param", "prompt")
                param = "messages" if chat and param == "prompt" else sampling.fields.get(param, param)
                raise ApiError(400, str(e), param=param, code=code) from e
            raise
        self.metrics.prompt_tokens.inc(len(prompt) * sampling.n)
        return completion

    def failure(self, completion: Completion, request_id: str) -> ApiError | None:
        """Why a finished request has no answer, or None: a choice failed in the engine (500; the log
        has the engine's error), or the engine stopped under it (503: the server is shutting down; a
        request its client left is cancelled too, but then nobody asks)."""
        if any(job.failed for job in completion.jobs):
            return internal_error(request_id)
        reasons = [job.finish_reason for job in completion.jobs]
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
        logprobs = job.logprobs(kind == "chat", job.shown)
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
            async for job, delta, shown in completion.chunks():
                if delta or (job.handle.request.logprobs is not None and job.logprobs_sent < shown):
                    yield sse([self.choice(job, kind, delta, None, chunk=True)])
            error = self.failure(completion, request_id)
            if error:
                yield f"data: {json.dumps(error.body())}\n\n"
            else:
                for job in completion.jobs:
                    yield sse([self.choice(job, kind, "", job.finish_reason, chunk=True)])
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
            raise bad("lora_path", "`lora_path` must not contain NUL characters.")
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
                raise bad(key, f"`{key}` must be a non-empty string.")
        folder = self.adapter_folder(path)
        self.check_alive()
        # Checked and taken with no await in between, so atomic on the event loop: of two loads under
        # one new name, the second gets adapter_exists here (and the engine's AdapterExists backs it up).
        exists = ApiError(400, f"The name {show(name)} is already in use (an adapter or the base model).",
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
            raise ApiError(404, f"No adapter named {show(name)} is loaded.", param="lora_name", code="model_not_found")
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
