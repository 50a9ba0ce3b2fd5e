"""The HTTP side of one engine: the Server (its state, what its endpoints share) and the FastAPI app
(``build_app``: the error handlers, the routes, the front door). What the endpoints do is in
completions.py (completions and chat) and admin.py (adapters); the front door is front_door.py."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .grammars import MAX_PENDING
from .admin import AdapterAdmin
from .bridge import Job
from .completions import Completions
from .front_door import REQUEST_ID, FrontDoor, require_key
from .metrics import Metrics
from .errors import ApiError, internal_error, not_found, shutting_down
from .protocol import MAX_BODY_BYTES
from .structured import GRAMMAR_COMPILE_TIMEOUT, make_grammars
from .text import prompt_chars_bound

logger = logging.getLogger("hf_invisiblelora.serve")


class Server(Completions, AdapterAdmin):
    """The HTTP side of one engine: its state, the completion and chat endpoints (Completions), the
    adapter endpoints (AdapterAdmin), /v1/models and /health; ``build_app`` routes to them.

    ``root``: the base model's folder (as given, for /v1/models; each adapter's is the engine's,
    Engine.adapter_paths). ``api_key``: None, or what ``Authorization: Bearer`` must carry on /v1; adapters
    load at run time only if ``runtime_updates``, from inside ``lora_roots`` (resolved folders;
    none: anywhere); bodies of at most ``max_body_bytes``. Structured outputs' grammars are compiled
    by ``grammars`` (decode.grammar.Grammars: its process starts with the app's lifespan, or at the
    first compilation), each within ``grammar_compile_timeout`` seconds, at most ``max_pending_grammars``
    waiting to be compiled."""

    def __init__(self, engine, tokenizer, model_id: str, root: str | None = None, *, api_key: str | None = None,
                 runtime_updates: bool = False, lora_roots: list[str] = (), max_body_bytes: int = MAX_BODY_BYTES,
                 grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT, max_pending_grammars: int = MAX_PENDING):
        self.engine, self.tokenizer, self.model_id, self.root = engine, tokenizer, model_id, root
        self.api_key, self.runtime_updates, self.lora_roots = api_key, runtime_updates, list(lora_roots)
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.in_flight: dict[int, Job] = {}
        self.metrics = Metrics(engine, model_id)
        self.encode_lock = threading.Lock()  # one fast tokenizer is not safe to call from several threads
        self.max_prompt_chars = prompt_chars_bound(tokenizer, engine.max_request_tokens)
        self.draining = False  # SIGTERM: new requests get 503 (Graceful)
        self.active = 0  # HTTP requests being answered (FrontDoor)
        # None (and why not) where xgrammar is missing or cannot read the tokenizer: structured fields get 400
        self.grammars, self.grammars_missing = make_grammars(tokenizer, engine.vocab_size, engine.eos_ids,
                                                             grammar_compile_timeout, max_pending_grammars)

    def start_grammars(self) -> None:
        """Start the grammar compiler's process in the background (its imports take seconds), so the
        first structured request does not wait for it."""
        if self.grammars is not None:
            threading.Thread(target=self._start_grammars, name="hf_invisiblelora-grammars-start", daemon=True).start()

    def _start_grammars(self) -> None:
        try:
            self.grammars.start()
        except Exception:  # noqa: BLE001 - the first compilation tries again, and says so
            logger.exception("the grammar compiler did not start")

    def close(self) -> None:
        """Stop what the server runs beside the engine (the grammar compiler's process)."""
        if self.grammars is not None:
            self.grammars.close()

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

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """A prompt of more characters than the longest request's tokens can hold is refused before
        it is tokenized (text.prompt_chars_bound)."""
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"The prompt is {chars} characters, more than {self.engine.max_request_tokens} tokens "
                           f"(this server's longest request) can hold.", param=param, code="context_length_exceeded")

    def encode(self, text: str, special: bool = True, param: str = "prompt") -> list[int]:
        self.check_prompt_chars(len(text), param)
        with self.encode_lock:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def token_text(self, token: int) -> str:
        """A token's own text (logprobs), as vLLM shows it."""
        return self.tokenizer.decode([token])

    def models(self) -> dict:
        entry = dict(object="model", created=self.created, owned_by="hf_invisiblelora")
        data = [dict(entry, id=self.model_id, root=self.root or self.model_id, parent=None)]
        data += [dict(entry, id=name, root=path, parent=self.model_id)
                 for name, path in self.engine.adapter_paths().items()]
        return {"object": "list", "data": data}

    def health(self) -> tuple[dict, int]:
        ok = self.alive()
        return ({"status": "ok" if ok else "engine stopped", "model": self.model_id, "adapters": self.engine.adapters(),
                 "queue_length": self.engine.queue_length(), "running_rows": self.engine.running(),
                 "in_flight": len(self.in_flight)}, 200 if ok else 503)


def build_app(server: Server, stop_engine_on_shutdown: bool = False):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start_grammars()
        yield
        server.close()
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
