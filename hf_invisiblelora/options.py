"""The options of InvisibleLoRA decoding and of the serving engine, each defined and checked once.

    Options(gate="never", draft_dtype=torch.int4)    # generate()'s keywords; the engine's decoding options
    Limits(max_batch=8, max_loras=4)                 # the serving engine's bounds

generate() (api.py), the serving engine (engine/engine.py) and the server's command line
(serving/cli.py: its choices read from here) all build these, so an option means one thing
everywhere and a bad value is refused with one message. What a value resolves to on a given model
(the drafters' dtypes on its device, the compile backend) is decided where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .lora.files import MAX_RANK

GATES = ("auto", "always", "never")
LORA_BACKENDS = ("bank", "peft")
COMPILE = ("auto", True, False)
PREPACK = ("auto", True, False)
DRAFT_DTYPES = (torch.bfloat16, torch.float16, torch.int8, torch.int4)
PREFILL_CHUNK = 512  # prompt tokens per prefill pass (rows x tokens)


def _one_of(name: str, value, choices) -> None:
    # `is` for True / False: 1 == True, and "auto" must not match a 1
    if not any(value is c or isinstance(c, str) and value == c for c in choices):
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}.")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")


def _int(name: str, value, low: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= {low}, got {value!r}.")


def check_draft_dtype(value) -> tuple | None:
    """``draft_dtype``: "auto" (None returned: decided on the model, drafters.py), or one of
    DRAFT_DTYPES / None (full precision), or a list of distinct such choices: returned as a tuple."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"draft_dtype must be \"auto\", a dtype or a list of them, got {value!r}.")
        return None
    choices = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if not choices or len(set(choices)) != len(choices):
        raise ValueError(f"draft_dtype as a list needs distinct choices (None: full precision), got {value!r}.")
    for d in choices:
        if d is not None and d not in DRAFT_DTYPES:
            raise ValueError(f"draft_dtype must be one of {[str(d) for d in DRAFT_DTYPES]} (or a list of them and "
                             f"None), got {d!r}.")
    return choices


@dataclass(frozen=True)
class Options:
    """generate(..., invisible_lora=True)'s keywords (api.py's docstring says what each does); the
    serving engine takes the same ones but ``lora_backend`` and ``compile``.

    ``num_draft_tokens``: the most drafts per cycle; ``gate``: GATES; ``lora_backend``: LORA_BACKENDS;
    ``compile``: COMPILE; ``draft_vocab``: None, a number of tokens or a list of token ids;
    ``draft_dtype``: see ``check_draft_dtype``; ``prompt_lookup``: a bool; ``prepack``: PREPACK."""

    num_draft_tokens: int = 4
    gate: str = "auto"
    lora_backend: str = "bank"
    compile: object = "auto"
    draft_vocab: object = None
    draft_dtype: object = "auto"
    prompt_lookup: bool = True
    prepack: object = "auto"

    def __post_init__(self):
        _one_of("gate", self.gate, GATES)
        _int("num_draft_tokens", self.num_draft_tokens, low=0)
        _one_of("lora_backend", self.lora_backend, LORA_BACKENDS)
        _one_of("compile", self.compile, COMPILE)
        _one_of("prepack", self.prepack, PREPACK)
        _flag("prompt_lookup", self.prompt_lookup)
        vocab = self.draft_vocab
        if vocab is not None and not (isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0
                                      or isinstance(vocab, (list, tuple, torch.Tensor))):
            raise ValueError(f"draft_vocab must be a number of tokens (> 0) or a list of token ids, got {vocab!r}.")
        check_draft_dtype(self.draft_dtype)

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class Limits:
    """The serving engine's bounds (engine.py's docstring): ``max_batch`` rows of ``max_len`` slots,
    ``max_queue`` waiting requests, ``max_loras`` distinct adapters in a pass (None: no bound),
    ``max_cpu_loras`` adapters loaded (None: engine.py's default), ``max_lora_rank``, the most
    prompt tokens a prefill pass takes (``prefill_chunk``; None: whole prompts), prefix caching and
    its bytes (None: engine.py's default)."""

    max_batch: int = 8
    max_len: int = 1024
    max_queue: int = 1024
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int = MAX_RANK
    prefill_chunk: int | None = PREFILL_CHUNK
    prefix_caching: bool = True
    prefix_cache_bytes: int | None = None

    def __post_init__(self):
        for name in ("max_batch", "max_len", "max_queue", "max_lora_rank"):
            _int(name, getattr(self, name))
        for name in ("max_loras", "max_cpu_loras", "prefill_chunk", "prefix_cache_bytes"):
            _int(name, getattr(self, name), optional=True)
        _flag("prefix_caching", self.prefix_caching)
