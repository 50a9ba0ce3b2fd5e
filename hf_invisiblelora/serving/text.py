"""A request's text: detokenized as its tokens come, cut where its stop strings and stop tokens say."""

from __future__ import annotations


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


def prompt_chars_bound(tokenizer, max_tokens: int) -> int:
    """The most characters a prompt of ``max_tokens`` tokens can have, with room to spare: a token
    covers at most as many characters as its longest string in the vocabulary (byte-level and
    SentencePiece tokens spell out what they cover; special tokens are counted), doubled for
    normalizers that drop characters. Longer text is refused before it is tokenized, which takes
    seconds and hundreds of MB for a megabyte."""
    longest = max((len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t), default=16)
    return 2 * max_tokens * max(longest, 1) + 1024


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
    """One request's text, detokenized incrementally (as vLLM and TGI do): each chunk's tokens are
    decoded with the chunk before them as context and the text past the context's is appended, so
    a chunk costs its own tokens, not the whole output again. A multi-byte character split across
    tokens is never emitted half: while the window's text ends in U+FFFD (an incomplete character)
    nothing is appended until later tokens complete it. The text ends where ``stops`` (a Stops)
    says, and a tail that could start a stop string is held back until it is known not to.
    ``prefix``: text before the output (echo)."""

    def __init__(self, tokenizer, stops: Stops | None = None, prefix: str = ""):
        self.tokenizer, self.stops, self.prefix = tokenizer, stops or Stops(), prefix
        self.tokens: list[int] = []
        self.output = ""  # the decoded output so far (whole characters)
        self.start = self.read = 0  # tokens[start:read]: the context of the next window; read: decoded up to
        self.searched = 0  # output characters searched for stop strings
        self.floor = None  # characters of the first min_tokens - 1 tokens' text (stop strings must end past it)
        self.text = prefix
        self.sent = 0  # characters emitted
        self.stopped = False
        self.completion_tokens = 0  # tokens up to (and including) the one that completed a stop string

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _advance(self, upto: int, final: bool = False) -> None:
        """Decode tokens[read:upto] onto ``output`` (not while a character is incomplete, unless ``final``)."""
        if upto <= self.read:
            return
        context = self._decode(self.tokens[self.start:self.read])
        text = self._decode(self.tokens[self.start:upto])
        if text.endswith("\ufffd") and not final:
            return
        self.output += text[len(context):]
        self.start, self.read = self.read, upto

    def _stop(self) -> int | None:
        """Where the first stop string in the new part of ``output`` starts (or ends, with include)."""
        stops, m = self.stops, self.stops.min_tokens
        if not stops.strings or len(self.tokens) < m:
            return None
        if self.floor is None:
            self.floor = len(self._decode(self.tokens[: m - 1])) if m > 1 else 0
        found = []
        for s in stops.strings:
            i = self.output.find(s, max(0, self.floor - len(s) + 1, self.searched - len(s) + 1))
            if i >= 0:
                found.append((i, i + len(s)))
        self.searched = len(self.output)
        if not found:
            return None
        start, end = min(found)
        return end if stops.include else start

    def add(self, tokens: list[int]) -> str:
        """Take a chunk of committed tokens; return the text now safe to emit."""
        if self.stopped or not tokens:
            return ""
        before = len(self.tokens)
        self.tokens += tokens
        self._advance(len(self.stops.text_tokens(self.tokens)))
        cut = self._stop()
        if cut is None:
            self.text, self.completion_tokens = self.prefix + self.output, len(self.tokens)
            return self._emit(len(self.text) - held_tail(self.output, self.stops.strings))
        self.stopped = True
        self.text = self.prefix + self.output[:cut]
        # the token that completed it: a few whole decodes, once per request
        self.completion_tokens = next((i for i in range(before + 1, len(self.tokens) + 1)
                                       if self.stops.cut(self._decode, self.tokens[:i]) is not None), len(self.tokens))
        return self._emit(len(self.text))

    def finish(self) -> str:
        """The rest of the text, held back or not."""
        if not self.stopped:
            self._advance(len(self.stops.text_tokens(self.tokens)), final=True)
            self.text = self.prefix + self.output
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:upto], upto
        return delta
