"""The API's side of a request: request bodies read safely, and the parameters of a completion or
chat request validated (every field honoured, neutral or refused; errors.py's objects say why).
"""

from __future__ import annotations

import json
import math

from starlette.concurrency import run_in_threadpool

from ..engine.engine import Request
from . import structured
from .errors import ApiError, bad, show

MAX_STOP_STRINGS = 16
MAX_BODY_BYTES = 4 * 2**20  # --max-body-bytes: room for a 1 MB prompt, or a list of a million token ids
MAX_JSON_DEPTH = 32  # the requests' own bodies are 5 deep (messages, content parts)
MAX_INT_DIGITS = 20  # 2**64, one past the largest seed, has 20


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


# --- request parameters ---


def _number(body: dict, name: str, default, *, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise bad(name, f"`{name}` must be {'an integer' if integer else 'a number'}, got {show(value)}.")
    if not integer:
        value = float(value)  # Transformers' warpers want floats
        if not math.isfinite(value):
            raise bad(name, f"`{name}` must be finite, got {show(value)}.")
    return value


def _unsupported(body: dict, name: str, allowed=(None,)) -> None:
    if body.get(name) not in allowed:
        raise ApiError(400, f"`{name}` is not supported by this server (got {show(body[name])}).", param=name,
                       code="unsupported_parameter")


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"`{name}` must be a boolean, got {show(value)}.")
    return bool(value)


# Fields a request may carry. Honoured: what Sampling reads. Neutral: accepted at the value that
# asks for nothing (vLLM's and OpenAI's defaults), refused otherwise. Anything else is refused by
# name, as OpenAI's API refuses an unrecognized argument: a field nobody reads must not pass as honoured.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
                 "include_stop_str_in_output", "stream", "stream_options", "min_tokens", "ignore_eos",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                 "prompt_logprobs", "echo", "user", "return_tokens_as_token_ids",
                 # structured outputs (structured.py): OpenAI's, vLLM's, vLLM's older ones
                 "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "guided_decoding_backend"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                               "continue_final_message", "tools", "tool_choice"}
NEUTRAL = {"best_of": (1,),
           "suffix": ("",), "tools": ([],), "functions": ([],), "tool_choice": ("none",), "function_call": ("none",),
           "use_beam_search": (False,), "truncate_prompt_tokens": (),
           "return_token_ids": (False,), "skip_special_tokens": (True,), "chat_template": (),
           "chat_template_kwargs": (), "parallel_tool_calls": ()}
CHAT_NEUTRAL = {"parallel_tool_calls": (True,)}  # a chat's tool calls may be several (false is not served)
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
MAX_N = 16  # choices per request: each takes a row of the engine


class Sampling:
    """A completion or chat request's parameters, validated: every field either honoured, neutral
    (NEUTRAL) or refused with a 400 naming it (docs/serving.md lists them)."""

    def __init__(self, body: dict, chat: bool):
        known = CHAT_FIELDS if chat else COMPLETION_FIELDS
        for name in body:
            if name not in known and name not in NEUTRAL:
                shown = name if len(name) <= 64 and name.isprintable() else show(name)
                raise ApiError(400, f"Unknown parameter `{shown}`.", param=shown, code="unsupported_parameter")
        for name, allowed in NEUTRAL.items():
            if name in known:
                continue
            _unsupported(body, name, (None, *(CHAT_NEUTRAL.get(name, allowed) if chat else allowed)))
        self.n = _number(body, "n", 1, integer=True)
        if not 1 <= self.n <= MAX_N:
            raise bad("n", f"`n` must be in [1, {MAX_N}], got {self.n}.")
        # The values' ranges are the engine's to check (Engine.validate, one validation): here only
        # what JSON may hold, and the API's own rules.
        self.temperature = _number(body, "temperature", 1.0)
        self.top_p = _number(body, "top_p", 1.0)
        self.top_k = _number(body, "top_k", 0, integer=True)  # an extension (vLLM's): 0 or -1 = no limit
        if self.top_k < -1:
            raise bad("top_k", f"`top_k` must be >= 1, or 0 / -1 for no limit; got {self.top_k}.")
        self.top_k = max(self.top_k, 0)
        self.min_p = _number(body, "min_p", 0.0)
        self.repetition_penalty = _number(body, "repetition_penalty", 1.0)
        self.presence_penalty = _number(body, "presence_penalty", 0.0)
        self.frequency_penalty = _number(body, "frequency_penalty", 0.0)
        self.logit_bias = body.get("logit_bias")  # its keys and values: the engine's check
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", "`logit_bias` must be an object of token ids (as strings) to biases.")
        self.prompt_logprobs = _number(body, "prompt_logprobs", None, integer=True)  # vLLM's
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        self.max_tokens, self.max_tokens_field = None, "max_tokens"
        for name in names:
            value = _number(body, name, None, integer=True)
            if self.max_tokens is None and value is not None:
                self.max_tokens, self.max_tokens_field = value, name
        self.min_tokens = _number(body, "min_tokens", 0, integer=True)
        self.seed = _number(body, "seed", None, integer=True)  # its range: the engine's check
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "`stop` must be a non-empty string or a list of them.")
        if len(stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"At most {MAX_STOP_STRINGS} stop strings, got {len(stop)}.")
        self.stop = stop
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("stop_token_ids", "`stop_token_ids` must be a list of token ids.")
        self.stop_token_ids = ids
        self.include_stop = _flag(body, "include_stop_str_in_output")
        self.ignore_eos = _flag(body, "ignore_eos")
        self.echo = _flag(body, "echo")
        echo_only = self.max_tokens == 0 and self.echo and not chat
        if self.max_tokens is not None and self.max_tokens < 1 and not echo_only:
            # vLLM's rule: SamplingParams wants max_tokens >= 1; a completion with echo and max_tokens 0 is the
            # prompt only (its echo_without_generation), as lm-evaluation-harness scores a prompt
            field = self.max_tokens_field
            raise bad(field, f"`{field}` must be at least 1, got {self.max_tokens}"
                             f"{'' if chat else ' (0 is served with echo: the prompt only)'}.")
        self.token_ids_as_text = _flag(body, "return_tokens_as_token_ids")  # vLLM's: logprobs' tokens as "token_id:N"
        self.stream = _flag(body, "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or (options and not self.stream) or set(options) - STREAM_OPTIONS:
            raise bad("stream_options", "`stream_options` must be an object of include_usage and "
                       "continuous_usage_stats, and only given with stream=true.")
        if self.stream and self.prompt_logprobs is not None:
            raise ApiError(400, "`prompt_logprobs` is served on requests that are not streamed (echo with logprobs "
                           "streams the prompt's log-probabilities).", param="prompt_logprobs",
                           code="unsupported_parameter")
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
                raise bad("continue_final_message", "`continue_final_message` continues the last message, so it "
                           "needs add_generation_prompt=false.")
        else:  # logprobs: N, the most likely tokens besides the chosen one (0: the chosen one's only)
            self.logprobs = _number(body, "logprobs", None, integer=True)
        # echo with logprobs: the prompt's tokens come first in the answer's logprobs, with as many top ones
        self.echo_logprobs = self.echo and not chat and self.logprobs is not None
        # the engine's field -> the request's, where they differ
        self.fields = {"max_tokens": self.max_tokens_field, "logprobs": "top_logprobs" if chat else "logprobs"}
        if self.echo_logprobs and (self.prompt_logprobs is None or self.prompt_logprobs < self.logprobs):
            self.engine_prompt_logprobs = self.logprobs
            self.fields["prompt_logprobs"] = "logprobs"
        else:
            self.engine_prompt_logprobs = self.prompt_logprobs
        self._structured(body, chat)

    def _structured(self, body: dict, chat: bool) -> None:
        """``constraint``: what the output is compiled to (a structured.Constraint), from at most one
        of response_format, structured_outputs, guided_* and a chat's tool_choice required / named;
        ``tools``: a chat's tools (structured.Tools), or None."""
        constraints = structured.output_constraints(body)
        self.tools = structured.parse_tools(body) if chat else None
        if self.tools is not None and self.tools.constraint is not None:
            constraints.insert(0, self.tools.constraint)
        if len(constraints) > 1:
            first, second = constraints[0], constraints[1]
            what = "tool_choice" if first.param.startswith("tools") else f"`{first.param.split('.')[0]}`"
            raise ApiError(400, f"`{second.param.split('.')[0]}` and {what} both constrain the output; give one.",
                           param=second.param.split(".")[0], code="invalid_value")
        self.constraint = constraints[0] if constraints else None
        if self.constraint is not None:
            self.fields["grammar"] = self.constraint.param
        if self.tools is not None and self.tools.mode != "none" and self.echo:
            raise ApiError(400, "`echo` is not served with tools (with tool_choice \"none\" it is).", param="echo",
                           code="unsupported_parameter")

    def request(self, prompt: list[int], adapter: str, max_tokens: int, seed, grammar=None):
        """The engine's Request for one choice (``grammar``: the constraint's CompiledGrammar)."""
        return Request(prompt, adapter=adapter, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                       presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                       logit_bias=self.logit_bias, min_tokens=self.min_tokens,
                       stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                       prompt_logprobs=self.engine_prompt_logprobs, seed=seed, grammar=grammar)
