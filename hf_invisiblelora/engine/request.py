"""A request to the serving engine (engine.py): what it asks for (``Request``), its one
validation, and its state as the engine runs it (``Handle``: status, row, tokens so far)."""

from __future__ import annotations

import enum
import itertools
import queue
import threading
from dataclasses import dataclass, field

from ..model.walk import BASE

_ids = itertools.count()
MAX_LOGPROBS = 20  # the most likely tokens a request may ask for with each token (vLLM's default max_logprobs)
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # tokens a request's logit_bias may name
# Request fields validate() normalizes: int, float, an optional int (int?) or token ids.
_FIELD_TYPES = {"temperature": "float", "top_p": "float", "min_p": "float", "repetition_penalty": "float",
                "presence_penalty": "float", "frequency_penalty": "float", "max_tokens": "int", "top_k": "int",
                "min_tokens": "int", "seed": "int?", "logprobs": "int?", "prompt_logprobs": "int?",
                "stop_token_ids": "ids"}


class Status(str, enum.Enum):
    WAITING = "waiting"  # queued, no row yet
    PREFILLING = "prefilling"  # in a row, its prompt's pass running
    DECODING = "decoding"  # in a row, cycles committing its tokens
    FINISHED = "finished"  # finish_reason says why


class InvalidRequest(ValueError):
    """What is wrong with a request; ``param``: the Request field it is about."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt plus max_tokens is longer than the engine's rows allow."""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _integer(value) -> int:
    if isinstance(value, bool) or not float(value).is_integer():
        raise ValueError(value)
    return int(value)


@dataclass
class Request:
    """One completion: prompt token ids, adapter ("__base__": none) and sampling settings
    (temperature 0: greedy; top_k 0: no limit; min_p 0: none), as generate() and vLLM take them:
    ``repetition_penalty`` over the prompt and the output, ``presence_penalty`` and
    ``frequency_penalty`` over the output (OpenAI's), ``logit_bias`` {token id: added to its logit}
    (OpenAI's), ``min_tokens`` before a stop token may come, ``stop_token_ids`` ending the request
    besides the model's EOS ids (``ignore_eos``: not those); ``max_tokens`` 0: the prompt only (its
    log-probabilities). ``logprobs``: None, or how many of the most likely tokens to return with each
    token's raw log-probability (``Handle.logprobs``); ``prompt_logprobs`` likewise for each prompt
    token after the first (``Handle.prompt_logprobs``, vLLM's). ``on_tokens(tokens)``, if given, is
    called (on the engine's thread) with each chunk of committed tokens; returning True stops the
    request there (stop strings). ``grammar``: an xgrammar CompiledGrammar (serving/grammars.py:
    ``Grammars.compile``) the output must follow: each token is chosen among the tokens it allows
    (its mask before temperature, top-k, top-p and min-p, as a logits processor in generate()), and
    the output ends where the grammar ends, with one of the request's stop tokens."""

    prompt: list
    adapter: str = BASE
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    min_tokens: int = 0
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    grammar: object = None
    on_tokens: object = None
    id: int = field(default_factory=lambda: next(_ids))


class Handle:
    """A submitted request and its state: iterate to get its committed token chunks; ``cancel()``
    frees its row at the next cycle. ``status``: waiting, prefilling, decoding or finished; ``row``:
    the engine's row it holds while prefilling or decoding. ``finish_reason``: "stop", "length", "cancelled" or "error" once finished
    (``error`` then says why: its on_tokens callback raised, or the engine failed in a step it was in).
    ``logprobs`` (a request that asked): per token so far, (log-probability, [(token id,
    log-probability)] of the most likely), filled before its chunk is handed over;
    ``prompt_logprobs`` (a request that asked): per prompt token, None for the first, then
    (log-probability, rank, [(token id, log-probability)] of the most likely), set before the first
    chunk is handed over."""

    def __init__(self, request: Request, engine):
        self.request, self.engine = request, engine
        self.status, self.row = Status.WAITING, None  # the row it decodes in, while it has one
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None
        self.finish_reason = None
        self.error = None
        self.drafted = self.accepted = 0
        self.ref = None  # the adapter revision it was admitted with (adapters.AdapterRef)
        self._chunks = queue.Queue()
        self.done = threading.Event()

    @property
    def revision(self) -> int | None:
        """The revision of its adapter it decodes with (Engine.load_adapter(inplace=True) makes new
        ones), once admitted."""
        return None if self.ref is None else self.ref.revision

    def cancel(self) -> None:
        self.engine._cancel(self)

    def _put(self, tokens: list[int], logprobs=()) -> bool:
        """Hand over committed tokens; True if the request's on_tokens callback asks to stop."""
        self.tokens += tokens
        self.logprobs += logprobs
        self._chunks.put(tokens)
        return bool(self.request.on_tokens and self.request.on_tokens(tokens))

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.status, self.row = Status.FINISHED, None
            self.finish_reason, self.error = reason, error
            self._chunks.put(None)
            self.done.set()

    def __iter__(self):
        while (chunk := self._chunks.get()) is not None:
            yield chunk

    def result(self, timeout: float | None = None) -> list[int]:
        """All generated tokens, once finished."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request.id} not finished after {timeout} s")
        return self.tokens


def _logit_bias(bias, vocab_size: int) -> dict | None:
    """``logit_bias`` as {token id: bias}: OpenAI's {"token id": bias in [-100, 100]} (keys may be
    strings of digits, as JSON objects have them)."""
    if not bias:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("logit_bias", f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids "
                             "(as strings) to biases in [-100, 100].")
    out = {}
    for key, value in bias.items():
        try:
            token = _integer(key) if not isinstance(key, str) else int(key) if key.strip().isdigit() else None
        except (TypeError, ValueError):
            token = None
        if token is None or not 0 <= token < vocab_size:
            raise InvalidRequest("logit_bias", f"logit_bias has key {_shown(key)}, which is not a token id in "
                                 f"[0, {vocab_size}).")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidRequest("logit_bias", f"logit_bias[{token}] must be a number in [-100, 100], got "
                                 f"{_shown(value)}.")
        out[token] = float(value)
    return out


def validate(request: Request, vocab_size: int, max_request_tokens: int) -> None:
    """Raise InvalidRequest (a ValueError) naming the field that is wrong with ``request``;
    normalizes its numbers' types. The one validation of a request's values (the server checks
    only what its JSON may hold; the engine adds whether it serves the adapter)."""
    def check(ok, param, message):
        if not ok:
            raise InvalidRequest(param, message)

    check(request.prompt, "prompt", "The prompt is empty.")
    outside = next((t for t in request.prompt if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    check(outside is None, "prompt", f"The prompt holds token id {_shown(outside)}, which is out of vocabulary (token "
                                     f"ids are in [0, {vocab_size})).")
    for name, kind in _FIELD_TYPES.items():
        value = getattr(request, name)
        try:
            if kind == "ids":
                value = [_integer(t) for t in value]
            elif value is not None or kind in ("int", "float"):
                value = float(value) if kind.startswith("float") else _integer(value)
        except (TypeError, ValueError):
            what = {"ids": "a list of token ids", "float": "a number"}.get(kind.removesuffix("?"), "an integer")
            raise InvalidRequest(name, f"{name} must be {what}, got {value!r}.") from None
        setattr(request, name, value)
    check(isinstance(request.ignore_eos, bool), "ignore_eos", f"ignore_eos must be a boolean, got {request.ignore_eos!r}.")
    check(request.max_tokens >= 0, "max_tokens", f"max_tokens must be >= 0, got {request.max_tokens}.")
    check(request.temperature >= 0, "temperature", f"temperature must be >= 0, got {request.temperature}.")
    check(0 < request.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {request.top_p}.")
    check(request.top_k >= 0, "top_k", f"top_k must be >= 0, got {request.top_k}.")
    check(0 <= request.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {request.min_p}.")
    check(0 < request.repetition_penalty < float("inf"), "repetition_penalty",
          f"repetition_penalty must be > 0, got {request.repetition_penalty}.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        check(-2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value}.")
    check(request.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {request.min_tokens}.")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}.")
    request.logit_bias = _logit_bias(request.logit_bias, vocab_size)
    check(len(request.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
          f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(request.stop_token_ids)}.")
    outside = next((t for t in request.stop_token_ids if not 0 <= t < vocab_size), None)
    check(outside is None, "stop_token_ids",
          f"stop_token_ids holds token id {outside}, which is out of vocabulary (token ids are in [0, {vocab_size})).")
    check(request.seed is None or -(2**63) <= request.seed < 2**64, "seed",  # what torch's generators take
          f"seed must be in [-2**63, 2**64), got {request.seed}.")
    if request.grammar is not None:
        info = getattr(request.grammar, "tokenizer_info", None)
        check(info is not None and type(request.grammar).__name__ == "CompiledGrammar", "grammar",
              "grammar must be an xgrammar CompiledGrammar (Grammars.compile).")
        check(info.vocab_size <= vocab_size, "grammar", f"The grammar was compiled for a vocabulary of "
                                                        f"{info.vocab_size} tokens; the model has {vocab_size}.")
        # Where the grammar ends it allows only stop tokens, which min_tokens blocks: no token is left.
        check(not request.min_tokens, "min_tokens", "min_tokens cannot be combined with a structured output (its "
                                                    "grammar may end before them).")
    if len(request.prompt) + request.max_tokens > max_request_tokens:
        raise PromptTooLong("prompt", f"The prompt ({len(request.prompt)} tokens) plus max_tokens "
                            f"({request.max_tokens}) is longer than this server allows ({max_request_tokens} "
                            "tokens); shorten the prompt or max_tokens.")
