"""The requests in the serving engine's rows, and what a pass's committed tokens do to them: each
row's tokens (and log-probabilities) delivered to its request's handle, and the request's end (a
stop token or stop string, its budget, a cancel, an error), which frees its row for the next one.

It runs on the engine's thread (engine.py), between the decoder's passes (decoder.py): the
engine admits requests into free rows (``take``) and hands it each pass's committed tokens
(``deliver``).
"""

from __future__ import annotations

import logging

from ..model.walk import BASE
from .request import Status

logger = logging.getLogger("hf_invisiblelora")


class Rows:
    """``handles[r]``: the request (request.Handle) in row r, or None. ``policy``: the engine's
    RequestPolicy (log-probabilities); ``pool``: its AdapterManager (an adapter's last use);
    ``count(**added)``: adds to the engine's metrics; ``room``: the slots a row may use;
    ``ended(decoder, r, handle)``: called as a request ends, before its row is freed (its keys and
    values still in it)."""

    def __init__(self, capacity: int, policy, pool, count, room: int, ended=lambda decoder, r, h: None):
        self.handles = [None] * capacity
        self.policy, self.pool, self.count, self.room, self.ended = policy, pool, count, room, ended

    def free(self) -> list[int]:
        return [r for r, h in enumerate(self.handles) if h is None]

    def taken(self) -> list:
        """(row, handle) of every row that holds a request."""
        return [(r, h) for r, h in enumerate(self.handles) if h is not None]

    def adapters(self) -> list[str]:
        """The adapter of each request in a row."""
        return [h.request.adapter for h in list(self.handles) if h is not None]

    def take(self, group: list) -> None:
        """The (row, handle) pairs of ``group`` start prefilling in their rows."""
        for r, h in group:
            self.handles[r] = h
            h.status, h.row = Status.PREFILLING, r
            self.pool.touch(h.request.adapter)
        self.count(requests=len(group))

    def most_left(self, decoder) -> dict:
        """The adapters of the rows -> the most tokens one of their rows has left."""
        left = {}
        for r, h in self.taken():
            if h.request.adapter != BASE:
                left[h.request.adapter] = max(left.get(h.request.adapter, 0), decoder.rows[r].left)
        return left

    def prefilled(self, decoder, group: list, committed: list[int]) -> None:
        """The group's prompts are in the cache: their first tokens are delivered."""
        for r, h in group:
            h.status = Status.DECODING
            h.prompt_logprobs = self.policy.prompt_logprobs(r)
        self.deliver(decoder, committed)

    def deliver(self, decoder, committed: list[int]) -> None:
        """Each row's last ``committed[r]`` tokens to its request; requests that end are released. A
        failure ends only the rows it involves (``fail``)."""
        try:
            new = decoder.new_tokens(committed)
        except Exception as e:  # noqa: BLE001 - every row with tokens is involved
            self.fail(decoder, [(r, self.handles[r]) for r, n in enumerate(committed) if self.handles[r] is not None],
                      "delivery", e)
            return
        self.count(tokens=sum(n for r, n in enumerate(committed) if self.handles[r] is not None))
        for r, tokens in enumerate(new):
            h = self.handles[r]
            if h is None:
                continue
            try:
                if h.request.max_tokens == 0:  # its prompt only
                    self.release(decoder, r, "length")
                    continue
                if tokens:
                    top = h.request.logprobs
                    logprobs = () if top is None else \
                        self.policy.token_logprobs(r, decoder.rows[r].gen - len(tokens), tokens, top)
                    try:
                        stop = h._put(tokens, logprobs)
                    except Exception as e:  # noqa: BLE001 - the request's own callback failed: only it ends
                        self.release(decoder, r, "error", f"on_tokens raised {type(e).__name__}: {e}")
                        continue
                    if stop:
                        self.release(decoder, r, "stop")
                        continue
                reason = decoder.end_reason(r)
                if reason is not None:
                    self.release(decoder, r, reason)
            except Exception as e:  # noqa: BLE001 - only this row is involved
                self.fail(decoder, [(r, h)], "delivery", e)

    def release(self, decoder, r: int, reason: str, error: str | None = None) -> None:
        """Row r's request ends (``reason``); the row is freed for the next one."""
        h = self.handles[r]
        h.drafted, h.accepted = decoder.rows[r].drafted, decoder.rows[r].accepted
        self.pool.touch(h.request.adapter)
        if reason != "error":
            self.ended(decoder, r, h)
        self.handles[r] = None
        decoder.free(r)
        h._finish(reason, error)

    def drop(self, decoder, cancelled: set) -> None:
        """Release the rows whose request ids are in ``cancelled``."""
        for r, h in self.taken():
            if h.request.id in cancelled:
                self.release(decoder, r, "cancelled")

    def fail(self, decoder, involved: list, stage: str, error: Exception) -> None:
        """An unexpected exception in ``stage`` (called in its ``except``): the ``involved``
        (row, handle) pairs end with "error" and their rows are freed and reset, so the next
        admission starts them afresh; the other rows and the engine go on. If resetting fails too,
        the exception reaches the engine's thread, which fails."""
        logger.exception("hf_invisiblelora engine: %s failed; ending %d request(s), serving on", stage, len(involved))
        message = f"the engine failed in {stage}: {type(error).__name__}: {error}"
        self.count(failed_cycles=1,
                   failed_requests=sum(h is not None and h.finish_reason is None for _, h in involved))
        try:
            for r, h in involved:
                if self.handles[r] is h:
                    self.handles[r] = None
            decoder.reset([r for r, _ in involved], self.room)
        finally:  # the requests learn they failed even if the reset fails (and with it the engine)
            for r, h in involved:
                if h is not None:
                    h.drafted, h.accepted = decoder.rows[r].drafted, decoder.rows[r].accepted
                    h._finish("error", message)
