"""The completion and chat endpoints: a request's body to its engine requests (one per choice), and
their answer, whole or as server-sent events. A part of the Server (app.py), which holds the state."""

from __future__ import annotations

import json
import logging
import uuid

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..engine.adapters import NAME
from ..engine.engine import AdapterUnsupported, NotRunning, PromptTooLong, QueueFull, UnknownAdapter
from ..lora.files import AdapterRefused
from ..model.walk import BASE
from .bridge import ClientGone, Completion, Job
from .errors import ApiError, adapter_refused, bad, internal_error, not_found, show
from .protocol import Sampling, json_body
from .structured import compile_constraint, message_tool_calls
from .tool_calls import ToolCalls
from .text import Stops

logger = logging.getLogger("hf_invisiblelora.serve")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Completions:
    """The Server's /v1/completions and /v1/chat/completions (``complete``): parsing the prompt,
    submitting the choices, answering. Uses the Server's state (engine, tokenizer and
    ``encode_lock``, metrics, ``model_id``, ``max_body_bytes``) and its ``encode``,
    ``check_alive`` and ``unavailable``."""

    # parsing

    def adapter_for(self, model) -> str:
        if model is None or model in (self.model_id, BASE):
            return BASE
        if not isinstance(model, str):
            raise bad("model", f"`model` must be a string, got {show(model)}.")
        if model in self.engine.adapters():
            return model
        if self.engine.resolver is not None and NAME.fullmatch(model):  # looked up (and loaded) by Engine.validate
            return model
        raise not_found(model)

    def completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and len(prompt) > self.engine.max_request_tokens:
            raise ApiError(400, f"The prompt is {len(prompt)} tokens, more than this server allows "
                           f"({self.engine.max_request_tokens}).", param="prompt", code="context_length_exceeded")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt  # their range: Engine.validate
        raise bad("prompt", "`prompt` must be a string or a list of token ids (one prompt per request).")

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
            entry = {"role": m["role"], "content": content or ""}
            # tools' turns, as Transformers' chat templates read them
            if m["role"] == "assistant" and m.get("tool_calls") is not None:
                entry["tool_calls"] = message_tool_calls(m["tool_calls"], i)
            for key in ("tool_call_id", "name"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise bad("messages", f"messages[{i}].{key} must be a string.")
                    entry[key] = m[key]
            plain.append(entry)
        return plain

    def render_chat(self, messages: list, tools, sampling: Sampling | None = None) -> str:
        """The chat template's text (the caller holds encode_lock)."""
        kwargs = {} if tools is None else {"tools": tools}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=sampling.add_generation_prompt
                                                  if sampling else True,
                                                  continue_final_message=sampling.continue_final if sampling else False,
                                                  tokenize=False, **kwargs)

    def chat_prompt(self, body: dict, sampling: Sampling) -> list[int]:
        plain = self.chat_messages(body)
        tools = sampling.tools.tools if sampling.tools is not None else None
        extra = sum(len(json.dumps(m["tool_calls"])) for m in plain if "tool_calls" in m)
        extra += len(json.dumps(tools)) if tools else 0
        self.check_prompt_chars(sum(len(m["content"]) + len(m["role"]) for m in plain) + extra, "messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "This model's tokenizer has no chat template; use /v1/completions.",
                           param="messages", code="no_chat_template")
        try:
            with self.encode_lock:  # tools go to any template, as vLLM's: one without a tool format ignores them
                text = self.render_chat(plain, tools, sampling)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages
            raise ApiError(400, "This model's chat template refused these messages (for example, roles in an order "
                           "it does not accept).", param="messages", code="invalid_value", cause=e) from e
        return self.encode(text, special=False, param="messages")

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
        grammar = None
        if sampling.constraint is not None:  # compiled (or refused) before the request waits for a row
            if self.grammars is None:
                raise ApiError(400, f"Structured outputs are not served here: {self.grammars_missing}.",
                               param=sampling.constraint.param.split(".")[0].split("[")[0],
                               code="unsupported_parameter")
            grammar = await compile_constraint(self.grammars, sampling.constraint)
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
                request = sampling.request(prompt, adapter, max_tokens, seed, grammar)
                if i == 0:
                    await run_in_threadpool(self.engine.validate, request)
                self.check_alive()
                tools = sampling.tools
                job = Job(self, request, stops, i, completion.queue, prefix, sampling.token_ids_as_text,
                          sampling.echo_logprobs)
                if tools is not None and tools.mode != "none":
                    job.tools = ToolCalls(tools.mode, tools.name)
                completion.jobs.append(job)
        except BaseException as e:
            completion.close()
            if isinstance(e, QueueFull):
                raise ApiError(429, str(e), type="server_error", code="queue_full") from e
            if isinstance(e, NotRunning):  # stopped meanwhile
                raise self.unavailable() from e
            if isinstance(e, UnknownAdapter):  # unloaded meanwhile, or found in no resolver folder
                raise not_found(adapter) from e
            if isinstance(e, (AdapterRefused, AdapterUnsupported)):  # a resolver folder's adapter: not servable
                raise adapter_refused(e, "model") from e
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

    def choice(self, job: Job, kind: str, text: str, finish_reason, chunk: bool, first: bool = False,
               prompt_logprobs: bool = False, delta: dict | None = None) -> dict:
        """A choice of the answer, or of a chunk (``delta``: the chunk's fields, else ``text``'s)."""
        logprobs = job.logprobs(kind == "chat", job.shown)
        if kind != "chat":
            out = {"index": job.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            if prompt_logprobs:  # vLLM's, on the choice of a completion
                out["prompt_logprobs"] = job.prompt_logprobs()
            return out
        if not chunk:
            message = {"role": "assistant", "content": text}
            if job.tools is not None:
                message["content"], calls, finish_reason = job.tools.result(text, finish_reason)
                if calls:
                    message["tool_calls"] = calls
            return {"index": job.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        if first:  # a tool call's content may turn out null: the first chunk does not say ""
            delta = {"role": "assistant", "content": None if job.tools is not None else text}
        elif delta is None:
            delta = {"content": text} if text else {}
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
            wanted = sampling.prompt_logprobs is not None
            choices = [self.choice(job, kind, job.text.text, job.finish_reason, chunk=False, prompt_logprobs=wanted)
                       for job in completion.jobs]
            obj = self.response(completion, kind, choices, chunk=False)
            if wanted and chat:  # vLLM's, on the response of a chat
                obj["prompt_logprobs"] = completion.jobs[0].prompt_logprobs()
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
            if usage or sampling.include_usage and sampling.continuous_usage:  # vLLM's: continuous needs include_usage
                obj["usage"] = completion.usage()
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        try:
            if kind == "chat":
                for job in completion.jobs:
                    yield sse([self.choice(job, kind, "", None, chunk=True, first=True)])
            async for job, delta, shown in completion.chunks():
                fields = job.tools.feed(delta) if job.tools is not None and kind == "chat" else None
                if (fields if fields is not None else delta) or \
                        (job.handle.request.logprobs is not None and job.logprobs_sent < shown):
                    yield sse([self.choice(job, kind, delta, None, chunk=True, delta=fields)])
            error = self.failure(completion, request_id)
            if error:
                yield f"data: {json.dumps(error.body())}\n\n"
            else:
                for job in completion.jobs:
                    reason = job.finish_reason
                    if job.tools is not None and kind == "chat":  # what the text held back says
                        rest, reason = job.tools.finish(job.text.text, reason)
                        for fields in rest:
                            yield sse([self.choice(job, kind, "", None, chunk=True, delta=fields)])
                    yield sse([self.choice(job, kind, "", reason, chunk=True)])
                if sampling.include_usage:
                    yield sse([], usage=True)
        except Exception:  # noqa: BLE001 - the response has started: the client gets an error event, the log the rest
            logger.exception("request %s failed while streaming", request_id)
            yield f"data: {json.dumps(internal_error(request_id).body())}\n\n"
        finally:
            completion.close()
        yield "data: [DONE]\n\n"


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
