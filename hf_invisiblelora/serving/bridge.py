"""The bridge from the engine's thread to asyncio: a request's choices (Jobs) and their shared queue."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from .text import Stops, TextStream

logger = logging.getLogger("hf_invisiblelora.serve")


class ClientGone(Exception):
    pass


class Job:
    """One choice of a request: its engine request and handle, its text and the log-probabilities
    not yet sent. A thread of its own iterates the handle and detokenizes each chunk there (once,
    off the engine's thread and the event loop); a stop string found cancels the request (its row
    is freed at the next cycle; the text ends at the stop string whatever came after). It hands
    (text delta, tokens shown) to the event loop, into the queue the request's choices share."""

    def __init__(self, server, request, stops: Stops, index: int, queue: asyncio.Queue, prefix: str = "",
                 token_ids_as_text: bool = False, echo_logprobs: bool = False):
        self.server, self.index, self.queue, self.token_ids_as_text = server, index, queue, token_ids_as_text
        self.echo_logprobs, self.prompt_sent = echo_logprobs, False  # the prompt's tokens lead the logprobs (echo)
        self.loop = asyncio.get_running_loop()
        self.text = TextStream(server.tokenizer, stops, prefix)
        self.failed = False  # detokenizing raised (logged): the request was cancelled
        self.start = time.perf_counter()
        self.offset = len(prefix)  # text_offset of the next token (completions' logprobs)
        self.logprobs_sent = 0
        self.shown = 0  # tokens the event loop has been handed (usage so far)
        # (when the first chunk came, when the last did, tokens after the first chunk): time per output token
        self.token_times = None
        self.tools = None  # a chat's tool calls read from the text (tool_calls.ToolCalls), set by the caller
        self.handle = server.engine.submit(request)  # ValueError for a bad request
        server.in_flight[request.id] = self
        threading.Thread(target=self._pump, name=f"hf_invisiblelora-request-{request.id}", daemon=True).start()

    def _pump(self) -> None:
        try:
            for chunk in self.handle:
                if self.failed or self.text.stopped:
                    continue  # tokens committed before the cancellation took effect
                now = time.perf_counter()
                if self.token_times is None:
                    self.token_times = (now, now, 0)
                else:
                    first, _, n = self.token_times
                    self.token_times = (first, now, n + len(chunk))
                try:
                    delta = self.text.add(chunk)
                except Exception:  # noqa: BLE001 - only this request is involved
                    logger.exception("detokenizing request %s failed; cancelling it", self.handle.request.id)
                    self.failed = True
                    self.handle.cancel()
                    continue
                if self.text.stopped:
                    self.handle.cancel()
                self._send((delta, self.text.completion_tokens))
            if not self.failed:
                self._send((self.text.finish(), self.text.completion_tokens))
        except Exception:  # noqa: BLE001
            logger.exception("detokenizing request %s failed", self.handle.request.id)
            self.failed = True
        finally:
            self._send(None)

    def _send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self, item))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.text.stopped else self.handle.finish_reason

    def _decode(self, token: int) -> str:
        return f"token_id:{token}" if self.token_ids_as_text else self.server.token_text(token)

    def prompt_logprobs(self) -> list | None:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token {id: {logprob,
        rank, decoded_token}} of it and the most likely ones (None if not asked, or not computed)."""
        entries = self.handle.prompt_logprobs
        if entries is None:
            return None
        out = [None]
        for token, entry in zip(self.handle.request.prompt[1:], entries[1:]):
            lp, rank, top = entry
            ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
            item = {str(t): {"logprob": _finite(v), "rank": ranks[t], "decoded_token": self._decode(t)} for t, v in top}
            item[str(token)] = {"logprob": _finite(lp), "rank": rank, "decoded_token": self._decode(token)}
            out.append(item)
        return out

    def logprobs(self, chat: bool, upto: int):
        """The log-probabilities of the tokens shown (the first ``upto``) since the last call, in the
        API's shape (None if not asked); with ``echo_logprobs``, the prompt's tokens first (the first
        one's null), in the first call."""
        if self.handle.request.logprobs is None:
            return None
        tokens = self.handle.tokens[self.logprobs_sent:upto]
        entries = self.handle.logprobs[self.logprobs_sent:upto]
        if self.echo_logprobs and not self.prompt_sent and self.handle.prompt_logprobs is not None:
            self.prompt_sent = True
            prompt = [(lp, top) for lp, _, top in self.handle.prompt_logprobs[1:]]
            tokens, entries = self.handle.request.prompt + tokens, [None, *prompt, *entries]
            self.offset = 0  # the echoed prompt's text comes first
        self.logprobs_sent = max(upto, self.logprobs_sent)
        decode = self._decode
        if chat:
            def item(t, lp):
                text = decode(t)
                return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                                for t, (lp, top) in zip(tokens, entries)]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, entry in zip(tokens, entries):
            text = decode(t)
            out["tokens"].append(text)
            if entry is None:  # the prompt's first token: nothing before it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                lp, top = entry
                out["token_logprobs"].append(_finite(lp))
                out["top_logprobs"].append({**{decode(i): _finite(v) for i, v in top}, text: _finite(lp)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def close(self) -> None:
        """Cancel the request if it is not finished (a client that went away) and forget it."""
        reason = self.finish_reason or "cancelled"
        if self.handle.finish_reason is None:
            self.handle.cancel()
        if self.server.in_flight.pop(self.handle.request.id, None) is not None:
            self.server.metrics.finished.labels(reason).inc()
            self.server.metrics.latency.observe(time.perf_counter() - self.start)
            first, last, n = self.token_times or (0, 0, 0)
            if n > 0:
                self.server.metrics.per_output_token((last - first) / n)


def _finite(logprob: float) -> float:
    """JSON has no -inf or NaN: below -9999 (vLLM's clamp) and NaN (a row whose logits were not
    finite) are -9999."""
    return logprob if logprob >= -9999.0 else -9999.0


class Completion:
    """One completion request: its ``n`` choices (Jobs) and what they share (id, prompt, queue)."""

    def __init__(self, id: str, model_name: str, prompt_tokens: int):
        self.id, self.model_name, self.prompt_tokens = id, model_name, prompt_tokens
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs: list[Job] = []
        self.first_token_s = None

    async def chunks(self):
        """(job, text delta, tokens shown) as they come, until every choice has finished."""
        left = len(self.jobs)
        while left:
            job, item = await self.queue.get()
            if item is None:
                left -= 1
                continue
            if self.first_token_s is None:
                self.first_token_s = time.perf_counter() - self.jobs[0].start
                self.jobs[0].server.metrics.first_token(self.first_token_s)
            job.shown = item[1]
            yield job, *item

    async def collect(self, request) -> None:
        """Wait for every choice (a non-streaming call); a client that disconnects meanwhile raises ClientGone."""
        async def consume():
            async for _ in self.chunks():
                pass

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
        completion = sum(job.shown for job in self.jobs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def close(self) -> None:
        for job in self.jobs:
            job.close()
