"""Structured outputs: a grammar's token mask at every position a pass scores, exact under speculation.

Grammars are xgrammar's (a JSON schema, any JSON, a regex, a list of choices, an EBNF grammar),
compiled for a tokenizer into a ``CompiledGrammar``. Measured against llguidance on SmolLM2's
vocabulary (docs/benchmarks.md, "Structured outputs"): xgrammar's masks cost a few microseconds a
position, llguidance's tens, and xgrammar ships the Transformers logits processor that stock
generate() is run with.

- ``GrammarMask``: a logits processor. Position t of row b may take only the tokens the row's
  grammar allows after the row's output before t; every other token's score is -inf, as
  xgrammar's Transformers processor (``xgrammar.contrib.hf.LogitsProcessor``) masks each step of
  standard decoding. That processor keeps one matcher per row and advances it by the last token
  at each call, which holds only for calls one step apart. Here the mask is a function of the
  output: a speculative pass asks about draft positions, then about a shorter output again after
  a rejection, in any order. Each row's matcher follows the output asked about last: it rolls
  back to the longest common prefix and accepts the rest; masks are kept per position, so a
  verify pass reuses the drafts' masks. A position after a token the grammar refuses is never
  committed (that token's own position masks it out: the target cannot pick it, nor accept it as
  a draft), so it is left unmasked.
The server compiles a request's grammar (serving/grammars.py); generate() takes xgrammar's own
Transformers processor and swaps it for this one (``grammar_masks``).
"""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def blocked(bitmask: torch.Tensor) -> torch.Tensor:
    """xgrammar's bitmask of a position (int32 [words]: bit j of word w allows token 32 w + j) as the
    tokens it blocks (bool [32 words]). Scores masked with it are xgrammar's apply_token_bitmask_inplace's
    (-inf where blocked, the rest as they were), at a tenth of its cost on a 49k vocabulary."""
    return ((bitmask[:, None] >> _BITS) & 1).eq(0).reshape(-1)


class _Row:
    """One row's matcher, the output it has accepted, and the mask after each prefix of it."""

    def __init__(self, compiled, stop_tokens):
        import xgrammar as xgr

        kwargs = {} if stop_tokens is None else dict(override_stop_tokens=list(stop_tokens))
        self.matcher = xgr.GrammarMatcher(compiled, **kwargs)
        self.words = xgr.get_bitmask_shape(1, compiled.tokenizer_info.vocab_size)[1]
        self.tokens: list[int] = []
        self.masks: list = []  # masks[i]: after tokens[:i], filled when first asked
        self.ended = False  # the last token accepted ended the grammar: it takes no more

    def mask(self, output: list[int]):
        """The tokens blocked after ``output`` (``blocked``), or None if the grammar refuses a token of it."""
        n = len(self.tokens)
        common = 0
        while common < min(n, len(output)) and self.tokens[common] == output[common]:
            common += 1
        if self.ended and common == n:  # as xgrammar's processor: an ended matcher keeps its last mask
            return self._filled(n - 1)
        if common < n:
            self.matcher.rollback(n - common)
            del self.tokens[common:]
            del self.masks[common + 1:]
            self.ended = False
        for t in output[common:]:
            if not self.matcher.accept_token(t):
                return None
            self.tokens.append(t)
            if self.matcher.is_terminated():
                self.ended = True
                return self._filled(len(self.tokens) - 1)
        return self._filled(len(self.tokens))

    def _filled(self, i: int):
        """The mask after tokens[:i]: the matcher stands there, or one token past it (ended)."""
        del self.masks[len(self.tokens) + 1:]
        self.masks += [None] * (len(self.tokens) + 1 - len(self.masks))
        if self.masks[i] is None:
            back = len(self.tokens) - i
            if back:
                self.matcher.rollback(back)
            bitmask = torch.empty(1, self.words, dtype=torch.int32)
            self.matcher.fill_next_token_bitmask(bitmask)
            self.masks[i] = blocked(bitmask[0])
            for t in self.tokens[i:]:
                self.matcher.accept_token(t)
        return self.masks[i]


class GrammarMask:
    """A logits processor: row b's scores where its grammar allows no token are -inf. Row b's output
    is ``input_ids[b, prompt_len:]``; ``compiled``: one CompiledGrammar for every row, or one per row
    (xgrammar's Transformers processor takes the same); ``stop_tokens``: the tokens that end the
    grammar (None: the compiled grammar's tokenizer's). See the module docstring."""

    def __init__(self, compiled, prompt_len: int, stop_tokens=None):
        self.compiled = list(compiled) if isinstance(compiled, (list, tuple)) else [compiled]
        self.prompt_len, self.stop_tokens = prompt_len, stop_tokens
        self.rows: dict[int, _Row] = {}
        self.asked = None  # the rows to mask (only_rows); None: all

    def only_rows(self, rows) -> "GrammarMask":
        """This processor asked about ``rows`` only (the others' results of a call are dropped)."""
        view = object.__new__(GrammarMask)
        view.__dict__.update(self.__dict__)
        view.asked = set(rows)
        return view

    def _row(self, b: int, batch: int) -> _Row:
        if b not in self.rows:
            if len(self.compiled) not in (1, batch):
                raise RuntimeError(f"{len(self.compiled)} compiled grammars for a batch of {batch} rows: give one, "
                                   "or one per row")
            self.rows[b] = _Row(self.compiled[b if len(self.compiled) > 1 else 0], self.stop_tokens)
        return self.rows[b]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch = input_ids.shape[0]
        if scores.device.type != "cpu" and scores.device.type != "cuda":
            return self(input_ids, scores.cpu()).to(scores.device)  # as xgrammar's processor: masked on the CPU
        for b in range(batch):
            if self.asked is None or b in self.asked:
                mask = self._row(b, batch).mask(input_ids[b, self.prompt_len:].tolist())
                if mask is not None:  # in place, as xgrammar's processor (what aliases the scores sees it)
                    n = min(scores.shape[-1], mask.shape[0])
                    scores[b, :n].masked_fill_(mask[:n].to(scores.device), float("-inf"))
        return scores


def grammar_masks(processors, prompt_len: int):
    """generate()'s processors with each xgrammar Transformers processor in them replaced by the
    GrammarMask that decodes as it does (``from_transformers_processor``), in its place."""
    from transformers import LogitsProcessorList

    replaced = [from_transformers_processor(p, prompt_len) for p in processors]
    if not any(r is not None for r in replaced):
        return processors
    return LogitsProcessorList([r if r is not None else p for p, r in zip(processors, replaced)])


def from_transformers_processor(processor, prompt_len: int) -> GrammarMask | None:
    """The GrammarMask that decodes as ``processor`` does in standard decoding, if it is xgrammar's
    Transformers processor, fresh (as xgrammar requires: one per generate() call); else None. A
    subclass with code of its own is refused."""
    try:
        from xgrammar.contrib.hf import LogitsProcessor
    except ImportError:
        return None
    from .processors import behaves_as

    if not isinstance(processor, LogitsProcessor):
        return None
    if behaves_as(processor, (LogitsProcessor,)) is None:  # its own code, which may keep per-step state
        raise ValueError(f"{type(processor).__name__} changes xgrammar's LogitsProcessor, whose matchers advance one "
                         "step per call; invisible_lora calls processors at draft positions too. Pass xgrammar's "
                         "own processor, or use plain generate().")
    if processor.matchers:
        raise ValueError("this xgrammar LogitsProcessor has been used by a generate() call already; xgrammar "
                         "wants a new one for each call")
    return GrammarMask(processor.compiled_grammars, prompt_len)
