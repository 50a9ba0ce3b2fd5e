"""What every HTTP request passes before its route: FrontDoor (a request id, the response count by
endpoint and status, the drain's 503) and, on /v1 with --api-key, the API key (``require_key``).
A POST body's own checks (JSON only, its size) are protocol.json_body's."""

from __future__ import annotations

import secrets
import uuid
from typing import TYPE_CHECKING

from fastapi import Depends
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import MutableHeaders

from .errors import ApiError, shutting_down

if TYPE_CHECKING:  # app.py imports this module
    from .app import Server

REQUEST_ID = "X-Request-Id"
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

