"""Prompt lookup: a drafter that runs no pass at all (Transformers' ``prompt_lookup_num_tokens``, vLLM's
"ngram" method). It proposes what followed an earlier occurrence of the row's last tokens in its own
context (its prompt and output), per row; the gate learns its acceptance per length of the match
(drafters.Plan's classes) and weighs it like any drafter's (drafters.py).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

from ..model.derived import SourceCheck
from .drafters import Plan

# Prompt lookup matches the row's last 3, then 2, then 1 tokens. On SmolLM2's greedy continuations
# of the zoo's held-out prompts (benchmarks/bench_lookup.py; docs/benchmarks.md, "Prompt lookup"),
# allowing 1-token matches gave more tokens per cycle and row than requiring 2 or 3 at every k.
LOOKUP_NGRAMS = (3, 1)


class Match(NamedTuple):
    """Where each row's continuation is read (``lookup``'s semantics): from ``start``, repeating with
    ``period``; ``ngram`` the length matched (0: none, the row's last token repeated)."""

    start: torch.Tensor
    period: torch.Tensor
    ngram: torch.Tensor


def match(tokens: torch.Tensor, ends: torch.Tensor, longest: int = LOOKUP_NGRAMS[0],
          shortest: int = LOOKUP_NGRAMS[1]) -> Match:
    """Semantics: per row b, with c = tokens[b, :ends[b]] (its committed tokens, ends[b] >= 1):
        for n = longest, ..., shortest: the latest i < len(c) - n with c[i : i + n] == c[-n:] (an
        earlier occurrence of the row's last n tokens); the first n that has one is taken:
        start = i + n, period = len(c) - n - i, ngram = n; a row with none: start = len(c) - 1,
        period = 1, ngram = 0.
    tokens [B, W], ends [B]. On the host, in NumPy (a few vectorized ops over the rows: a cycle's
    plan needs its labels there anyway; torch ops cost twice as much in dispatch at these sizes)."""
    device, e = tokens.device, ends.cpu().numpy()
    span = int(e.max())
    ctx = tokens[:, :span].cpu().numpy()
    rows, p = np.arange(ctx.shape[0]), np.arange(span)
    # ends[b, p]: c[p - n + 1 .. p] equals the row's last n tokens, for n = 1, 2, ...: one comparison more each
    ending = (ctx == ctx[rows, np.maximum(e - 1, 0)][:, None]) & (p <= (e - 2)[:, None])  # before the last token
    runs = [ending]
    for m in range(1, longest):
        same = np.zeros_like(ending)
        same[:, m:] = ctx[:, :-m] == ctx[rows, np.maximum(e - 1 - m, 0)][:, None]
        ending = ending & same & (e > m)[:, None]
        runs.append(ending)
    start, period, ngram = e - 1, np.ones_like(e), np.zeros_like(e)
    for n in range(longest, shortest - 1, -1):
        last = np.where(runs[n - 1], p, -1).max(1)  # the latest match of n tokens ends there
        take = (last >= 0) & (ngram == 0)
        start, period = np.where(take, last + 1, start), np.where(take, e - 1 - last, period)
        ngram = np.where(take, n, ngram)
    return Match(*(torch.from_numpy(v).to(device) for v in (start, period, ngram)))


def lookup(tokens: torch.Tensor, m: Match, k: int) -> torch.Tensor:
    """Semantics: proposal[b, j] = tokens[b, m.start[b] + j % m.period[b]] (what followed the match;
    past the row's end, continued with the repeat's period) -> [B, k]."""
    return tokens.gather(1, m.start[:, None] + torch.arange(k, device=tokens.device) % m.period[:, None])


class PromptLookupDrafter:
    """Drafts without a model pass: each row's proposals are what followed the latest earlier
    occurrence of its last tokens in its own context (``match``, ``lookup``), prompt and output. Its
    cost is a few tensor ops, so a verify pass of k + 1 tokens that costs little more than a plain
    step (small batches on a CPU, any batch on a GPU) pays from a low acceptance on: where text
    repeats its prompt or itself (code, quotes, lists, names, the loops of small models).

    How often a proposal is right depends on how long a match it continues: on SmolLM2's greedy
    continuations of the zoo's held-out prompts, a draft after a 3-token match was kept about 80%
    of the time, after 2 tokens about 65%, after 1 30-45% (docs/benchmarks.md, "Prompt lookup"). So each cycle's ``plan``
    labels every row with its match length, the gate learns acceptance per label and judges a row
    without a match as one that commits a single token, and drafts with it only where that pays.

    Its proposals are point masses: sampling keeps draft d with probability p(d) and otherwise
    samples the target's distribution without d (speculative sampling with q = one-hot;
    policies.GeneratePolicy.accept), so every committed token is an exact sample."""

    key = "/lookup"
    passes = False

    @contextlib.contextmanager
    def installed(self, context, check: SourceCheck | None = None):
        yield self  # nothing routed: it runs no pass

    def plan(self, batch, hi: int) -> Plan:
        m = match(batch.tokens[:hi], batch.ends(hi))
        return Plan([str(n) if n else None for n in m.ngram.tolist()], m)

    def propose(self, fwd, batch, hi: int, k: int, policy, plan: Plan | None = None):
        if not k:
            return batch.tokens.new_zeros(hi, 0), None
        end = batch.ends(hi)
        m = plan.detail if plan is not None else match(batch.tokens[:hi], end)
        drafts = lookup(batch.tokens[:hi], m, k)
        batch.tokens[:hi].scatter_(1, end[:, None] + torch.arange(k, device=end.device), drafts)  # the verify pass reads them
        return drafts, None

    def learn(self, batch, hi: int, accepted: list[int]) -> None:
        """Nothing to learn: its proposals are read from the rows' tokens."""
