"""Scale-out on Ray Serve: N replicas of the server's engine behind the same OpenAI routes, requests
routed to the replicas by their adapter with Ray Serve's model multiplexing.

    serve run hf_invisiblelora.serving.ray_app:app_builder model=/models/base lora=a=/lora/a,b=/lora/b \\
        num_replicas=2 max_batch=8
    serve run config.yaml          # the same keys under the application's ``args`` (lists as lists)

The keys are the server's options (``python -m hf_invisiblelora.serve --help``; ``max_batch`` for
``--max-batch``; ``lora`` and ``lora_root`` take a list or comma-separated values) plus
``num_replicas`` (default 1), ``num_cpus`` per replica (default 1; its torch threads unless
``threads`` is given) and ``max_adapters_per_replica`` (default ``max_cpu_loras``, else every
adapter). Ray Serve's proxy owns the HTTP side: its host and port are Serve's ``http_options``,
not ``host`` / ``port``.

- ``Router`` (the ingress): reads a request's JSON ``model`` and calls a replica with it as the
  multiplexed model id, so Ray Serve sends it to a replica that holds that adapter when one does;
  the replica's answer, streamed or not, is passed through as it comes. A replica that fails
  mid-request ends its requests (503 before the response started; an error event and ``[DONE]``
  in a stream) and the others serve on.
- ``LoRAReplica``: one process's engine and server (cli.build_server), its FastAPI app called in
  process for each request. An adapter the replica serves is registered with Ray Serve's
  multiplexing when a request names it (Ray Serve's least-recently-used bound per replica,
  ``max_adapters_per_replica``); the engine itself loads adapters on demand and evicts idle ones
  past ``max_cpu_loras`` (adapters.py), so the two agree on what a replica holds.

Runtime adapter loading (``allow_runtime_lora_updating``) is refused: one call would reach one
replica; the adapters are the application's config (``serve deploy`` a new one to change them).
"""

import argparse
import asyncio  # no "from __future__ import annotations": FastAPI reads the routes' Request annotations
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from . import cli
from .errors import ApiError
from .protocol import MAX_BODY_BYTES, parse_json

logger = logging.getLogger("hf_invisiblelora.serve")

RAY_KEYS = {"num_replicas": 1, "num_cpus": 1, "max_adapters_per_replica": None}
REPLICA_HEADER = "X-Replica"  # which replica answered (the replica's id in Ray Serve)
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


def server_argv(args: dict) -> list[str]:
    """The server's command line for the application's ``args`` (Ray's keys left out)."""
    actions = {a.dest: a for a in cli.parser()._actions if a.option_strings}
    argv = []
    for key, value in args.items():
        if key in RAY_KEYS:
            continue
        if key in ("host", "port"):
            raise ValueError(f"{key!r} is Ray Serve's under Ray (serve start --http-host / --http-port, or the "
                             "config's http_options), not the application's.")
        if key == "allow_runtime_lora_updating":
            raise ValueError("allow_runtime_lora_updating is not served under Ray: a load would reach one replica. "
                             "The adapters are the application's config; deploy a new one to change them.")
        action = actions.get(key.replace("-", "_"))
        if action is None:
            raise ValueError(f"unknown key {key!r}; the keys are the server's options ({sorted(actions)}) and "
                             f"{sorted(RAY_KEYS)}.")
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch
            on = str(value).strip().lower() in ("1", "true", "yes", "on")
            if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
                argv.append(action.option_strings[0 if on else 1])
            elif on:
                argv.append(flag)
            continue
        repeatable = action.nargs is None and isinstance(action.default, list)  # --lora a=x --lora b=y
        values = value if isinstance(value, (list, tuple)) else \
            str(value).split(",") if action.nargs == "+" or repeatable else [value]
        if repeatable:
            for v in values:
                argv += [flag, str(v)]
        else:
            argv += [flag, *map(str, values)]
    return argv


async def _call_app(app, method: str, path: str, query: bytes, headers: list, body: bytes):
    """Run one HTTP request through the ASGI ``app`` in this process: yields ``(status, headers)``, then
    the body's chunks as the app sends them. Closing the generator early (the client left) is a
    disconnect to the app."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, messages.put))
    try:
        while True:
            getter = asyncio.ensure_future(messages.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # the app's own exception, if it raised
                raise RuntimeError("the app ended without a complete response")
            message = getter.result()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 5)  # the app sees the disconnect and cancels its request
            except Exception:  # noqa: BLE001 - a timeout, or the app's error (which it logged)
                task.cancel()


@serve.deployment
class LoRAReplica:
    """One engine and its server (see the module docstring)."""

    def __init__(self, argv: list[str], max_adapters: int | None):
        args = cli.parse(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        server = cli.build_server(args)
        if isinstance(server, int):
            raise RuntimeError(f"the replica's server could not start (exit code {server}; see its log)")
        self.server = server
        self.app = cli.build_app(server)  # its lifespan does not run here: the grammar compiler starts now
        server.start_grammars()
        self.replica = serve.get_replica_context().replica_id.unique_id

        async def hold(name: str) -> str:
            return name  # the engine loads it when a request needs it (adapters.py)

        bound = max_adapters or max(len(server.engine.adapters()), 1)
        self.hold = serve.multiplexed(max_num_models_per_replica=bound)(hold)

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """One request through the server's app: ``(status, headers)`` first, then the body's chunks."""
        name = serve.get_multiplexed_model_id()
        if name and name in self.server.engine.adapters():
            await self.hold(name)  # Ray Serve now routes this adapter's requests here first
        async for item in _call_app(self.app, method, path, query, headers, body):
            if isinstance(item, tuple):
                item = (item[0], [*item[1], (REPLICA_HEADER, self.replica)])
            yield item

    def check_health(self):
        if not self.server.alive():  # Ray Serve replaces a replica whose engine has failed
            raise RuntimeError(f"the engine is not running: {self.server.engine.error}")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
            server.engine.stop()


router_app = FastAPI(title="hf_invisiblelora on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


@router_app.exception_handler(HTTPException)
async def _http_error(request, e: HTTPException):  # the router's own 404 / 405, in the API's error shape
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)


@serve.deployment
@serve.ingress(router_app)
class Router:
    """The application's ingress: each request to the replica its adapter routes to (see the module
    docstring)."""

    def __init__(self, replica, max_body_bytes: int = MAX_BODY_BYTES):
        self.replica, self.max_body_bytes = replica, max_body_bytes

    async def body(self, request: Request) -> bytes:
        """The request's body, refused (413) past max_body_bytes without reading it all."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"The request body is larger than {self.max_body_bytes} bytes.", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"The request body is larger than {self.max_body_bytes} bytes.",
                               code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def adapter(request: Request, body: bytes) -> str:
        """The body's JSON ``model`` (the multiplexed model id), or "" where there is none to read (the
        replica answers what is wrong with the request)."""
        if request.method != "POST" or "json" not in request.headers.get("content-type", ""):
            return ""
        try:  # the server's own guards (depth, huge integers, lone surrogates); the replica says what is wrong
            model = parse_json(body).get("model")
        except ApiError:
            return ""
        return model if isinstance(model, str) and 0 < len(model) <= 256 else ""

    @router_app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def v1(self, request: Request):
        return await self.forward(request)

    @router_app.get("/health")
    async def health(self, request: Request):
        return await self.forward(request)

    async def forward(self, request: Request):
        try:
            body = await self.body(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        headers = [(k, v) for k, v in request.headers.items()]
        handle = self.replica.options(stream=True, multiplexed_model_id=self.adapter(request, body))
        chunks = handle.http.remote(request.method, request.url.path, request.url.query.encode(), headers, body)
        try:
            status, reply_headers = await chunks.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica failed (died) before answering
            logger.warning("a replica failed before answering %s %s: %s", request.method, request.url.path, e)
            error = ApiError(503, "The replica serving this request failed; retry.", type="server_error",
                             code="replica_failed")
            return JSONResponse(error.body(), status_code=503)
        reply_headers = {k: v for k, v in reply_headers if k.lower() not in _HOP_BY_HOP}
        stream = "text/event-stream" in reply_headers.get("content-type", "")

        async def rest():
            try:
                async for chunk in chunks:
                    yield chunk
            except Exception as e:  # noqa: BLE001 - the replica died mid-response
                logger.warning("a replica failed while answering %s %s: %s", request.method, request.url.path, e)
                if stream:  # as the server ends a stream its engine failed in
                    error = ApiError(503, "The replica serving this request failed.", type="server_error",
                                     code="replica_failed")
                    yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
        return StreamingResponse(rest(), status_code=status, headers=reply_headers)


def app_builder(args: dict) -> serve.Application:
    """The application of ``args`` (``serve run ...:app_builder key=value ...``; the module docstring)."""
    args = dict(args)
    ray = {k: args.get(k, default) for k, default in RAY_KEYS.items()}
    argv = server_argv(args)
    parsed = cli.parse(argv)  # a wrong option fails here, before any replica starts
    num_replicas, num_cpus = int(ray["num_replicas"]), float(ray["num_cpus"])
    if parsed.threads is None:
        argv += ["--threads", str(max(int(num_cpus), 1))]
    max_adapters = ray["max_adapters_per_replica"]
    max_adapters = int(max_adapters) if max_adapters is not None else parsed.max_cpu_loras
    replica = LoRAReplica.options(num_replicas=num_replicas, ray_actor_options={"num_cpus": num_cpus}) \
        .bind(argv, max_adapters)
    return Router.options(ray_actor_options={"num_cpus": 0}).bind(replica, parsed.max_body_bytes)
