"""A request's text: detokenized as its tokens come, cut where its stop strings and stop tokens say."""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_invisiblelora.serve")


class Stops:
    """Where a request's text ends: at the first stop string that ends past the text of its first
    ``min_tokens - 1`` tokens (none counts before min_tokens tokens, as in vLLM), the stop string
    cut off unless ``include``; a stop token ending the request (its EOS ids unless ignore_eos, its
    stop_token_ids) leaves its text out unless ``include``, as vLLM does."""

    def __init__(self, strings=(), min_tokens: int = 0, include: bool = False, token_ids=()):
        self.strings, self.min_tokens, self.include = list(strings), min_tokens, include
        self.token_ids = set(token_ids)

    def cut(self, decode, tokens: list[int]) -> int | None:
        """Where the text of ``tokens`` (``decode`` gives it) ends, or None: no stop string in it."""
        if not self.strings or len(tokens) < self.min_tokens:
            return None
        text = decode(tokens)
        floor = len(decode(tokens[: self.min_tokens - 1])) if self.min_tokens > 1 else 0
        found = []
        for s in self.strings:
            i = text.find(s, max(0, floor - len(s) + 1))
            if i >= 0:
                found.append((i, i + len(s)))
        if not found:
            return None
        start, end = min(found)
        return end if self.include else start

    def text_tokens(self, tokens: list[int]) -> list[int]:
        """The tokens whose text is shown: a stop token at the end left out unless ``include``."""
        return tokens[:-1] if tokens and not self.include and tokens[-1] in self.token_ids else tokens


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
    emitted half (an incomplete one decodes as U+FFFD and is held back until it completes). The
    text ends where ``stops`` (a Stops) says, and a tail that could start a stop string is held back
    until it is known not to. ``prefix``: text before the output (echo)."""

    def __init__(self, tokenizer, stops: Stops | None = None, prefix: str = ""):
        self.tokenizer, self.stops, self.prefix = tokenizer, stops or Stops(), prefix
        self.tokens: list[int] = []
        self.text = prefix
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
        cut = self.stops.cut(self._decode, self.tokens)
        if cut is None:
            text = self._decode(self.stops.text_tokens(self.tokens))
            self.text, self.completion_tokens = self.prefix + text, len(self.tokens)
            safe = len(text.rstrip("\ufffd"))
            safe = len(self.prefix) + safe - held_tail(text[:safe], self.stops.strings)
        else:
            self.stopped = True
            self.text = self.prefix + self._decode(self.tokens)[:cut]
            safe = len(self.text)
            self.completion_tokens = next((i for i in range(before + 1, len(self.tokens) + 1)
                                           if self.stops.cut(self._decode, self.tokens[:i]) is not None),
                                          len(self.tokens))
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
    ends the text (``stops``), which ends the request at that cycle. Never raises (an exception
    there would stop the engine): on an error it ends the request."""

    def __init__(self, tokenizer, stops: Stops):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []

    def __call__(self, tokens: list[int]) -> bool:
        try:
            self.tokens += tokens
            return self.stops.cut(lambda t: self.tokenizer.decode(t, skip_special_tokens=True), self.tokens) is not None
        except Exception:  # noqa: BLE001
            logger.exception("stop-string check failed; ending the request")
            return True
