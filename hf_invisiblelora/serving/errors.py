"""The API's errors: OpenAI-style error objects with their HTTP status, and the ones every endpoint
gives (a refused adapter folder, an unknown model, an internal error, shutting down)."""

from __future__ import annotations

from ..engine.adapters import AdapterUnsupported
from ..lora.files import OutsideRoots, Unreadable


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


def adapter_refused(error: Exception, param: str) -> ApiError:
    """The 4xx of an adapter folder the engine would not load (``param``: the field that named it):
    403 for files outside the folders adapters are read from, 400 for what is missing, malformed or
    not servable (the engine's own words), and for PEFT's errors on files made for another model."""
    if isinstance(error, Unreadable):  # its message is ours: what is missing or malformed
        return ApiError(400, f"Could not load the PEFT adapter in `{param}`: {error}.", param=param,
                        code="adapter_load_failed")
    if isinstance(error, OutsideRoots):  # a file, or the folder swapped since a check
        return ApiError(403, f"The adapter's files must be inside the folders this server loads adapters from: "
                        f"{error}.", param=param, code="lora_path_not_allowed")
    if isinstance(error, AdapterUnsupported):  # its message is ours: what cannot be served, and why
        return ApiError(400, f"This server cannot serve the adapter: {error}", param=param, code="adapter_unsupported")
    return ApiError(400, f"Could not load the PEFT adapter in `{param}` onto this base model (its files are "
                    "incomplete, or made for another model).", param=param, code="adapter_load_failed", cause=error)


def not_found(model: str) -> ApiError:
    return ApiError(404, f"The model {show(model)} does not exist.", param="model", code="model_not_found")


def internal_error(request_id: str) -> ApiError:
    return ApiError(500, f"Internal error (request id {request_id}); the server's log has the details.",
                    type="server_error", code="internal_error")


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; retry later or elsewhere.", type="server_error",
                    code="server_shutting_down", headers={"Connection": "close"})


def show(value) -> str:
    """A client's value as error messages quote it: its repr, cut short (a value can be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")
