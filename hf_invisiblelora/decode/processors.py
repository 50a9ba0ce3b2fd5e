"""generate()'s logits processors and stopping criteria, shown what standard decoding shows them.

Standard decoding calls them once per step with the whole batch, ``input_ids`` [B, L], every row
of the same length L. Here rows stand at different lengths (they commit different numbers of
tokens per cycle), so for every length L some row needs, they are called with the whole batch's
first L tokens, exactly as standard decoding's step at length L called them (same batch indices,
same ``input_ids.shape[-1]``), and each row keeps the results of the calls at its own lengths.
Other rows' results of a call are dropped. Processors that read the scores alone (temperature,
top-k, ...) run once over all rows and positions. Scores are float32, as standard decoding makes them.

Contract, as in standard decoding: a processor or criterion computes each row from that row's
``input_ids`` and scores (and its batch index); it is called more often here (draft positions too).

Returned scores and logits (``output_scores`` / ``output_logits``) are made after decoding, by
``step_outputs``: the processors called once per step with the whole batch, as standard decoding's
step calls them. Stopping criteria that read ``scores`` are handed the tuple standard decoding hands
them when it returns scores (``ScoreHistory``).
"""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass

import torch
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

# Processors whose output depends on the scores alone (input_ids is not read).
_SCORES_ONLY = (
    lp.TemperatureLogitsWarper,
    lp.TopKLogitsWarper,
    lp.TopPLogitsWarper,
    lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper,
    lp.EpsilonLogitsWarper,
    lp.EtaLogitsWarper,
    lp.InfNanRemoveLogitsProcessor,
    lp.SuppressTokensLogitsProcessor,
    lp.LogitNormalization,
)
# Processors whose output depends on the scores and the length alone (input_ids' content is not
# read): EOS masked while a row is short of a minimum length.
_LENGTH_ONLY = (lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor)


def _short(p, kind, length: int) -> bool:
    """Semantics: whether ``p`` (of class ``kind``, _LENGTH_ONLY) masks EOS at ``input_ids.shape[-1] == length``."""
    if kind is lp.MinNewTokensLengthLogitsProcessor:
        return length - p.prompt_length_to_skip < p.min_new_tokens
    return length < p.min_length


def _min_length(p, kind, flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Semantics: ``p`` (of class ``kind``) applied to each row i of ``flat`` [N, V] at length
    ``lengths[i]``, in one op: its own torch.where(isin(vocab, eos), -inf, scores) where it applies."""
    short = torch.tensor([_short(p, kind, n) for n in lengths], device=flat.device)
    if not short.any():
        return flat
    eos = torch.isin(torch.arange(flat.shape[-1], device=flat.device), p.eos_token_id)
    return torch.where(short[:, None] & eos, -math.inf, flat)


def behaves_as(obj, classes: tuple) -> type | None:
    """The class of ``classes`` whose code ``obj`` runs, or None: ``obj`` is an instance of it and no
    class between (its subclasses) defines a method of its own but ``__init__``. A subclass that
    overrides ``__call__`` (or anything it calls) is user code and is treated as such."""
    for cls in type(obj).__mro__:
        if cls in classes:
            return cls
        if any(name != "__init__" and (inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod, property)))
               for name, v in vars(cls).items()):
            return None
    return None


def _only_rows(processor, rows: set[int]):
    """A PrefixConstrainedLogitsProcessor that asks its function only about ``rows`` (the function
    may reject the contexts of the other rows, which are not at this length); a GrammarMask that
    advances only their matchers."""
    if hasattr(processor, "only_rows"):
        return processor.only_rows(rows)
    if not isinstance(processor, lp.PrefixConstrainedLogitsProcessor):
        return processor
    fn, beams = processor._prefix_allowed_tokens_fn, processor._num_beams
    processor = copy.copy(processor)
    processor._prefix_allowed_tokens_fn = lambda batch_id, sent: fn(batch_id, sent) if batch_id * beams in rows else [0]
    return processor


def process_scores(processors, tokens: torch.Tensor, lengths: list[int], logits: torch.Tensor,
                   rows: list[int] | None = None) -> torch.Tensor:
    """Processed scores [B, q, V] float32: position t of row b follows ``tokens[b, :lengths[b] + t]``.

    ``rows``: the rows whose scores matter (others may be left unprocessed); default all.
    """
    scores = logits.float()
    if not processors:
        return scores
    b, q, v = scores.shape
    kinds = [behaves_as(p, _SCORES_ONLY) or behaves_as(p, _LENGTH_ONLY) for p in processors]
    if all(kinds):  # one call each over all rows and positions, not one per length
        flat = scores.reshape(b * q, v)
        ids = tokens[:1, :1].expand(b * q, 1)  # unread by these processors
        flat_lengths = [lengths[r] + t for r in range(b) for t in range(q)]
        for p, kind in zip(processors, kinds):
            flat = _min_length(p, kind, flat, flat_lengths) if kind in _LENGTH_ONLY else p(ids, flat)
        return flat.reshape(b, q, v)
    rows = range(b) if rows is None else rows
    wanted = {}  # length -> [(row, position)]
    for r in rows:
        for t in range(q):
            wanted.setdefault(lengths[r] + t, []).append((r, t))
    out = scores.clone()
    for length, at in sorted(wanted.items()):
        rs = torch.tensor([r for r, _ in at], device=scores.device)
        ts = torch.tensor([t for _, t in at], device=scores.device)
        col = torch.zeros(b, dtype=torch.long, device=scores.device)
        col[rs] = ts
        step = scores.gather(1, col[:, None, None].expand(b, 1, v))[:, 0]  # each row's scores at this length
        members = {r for r, _ in at}
        for p in processors:
            step = _only_rows(p, members)(tokens[:, :length], step)
        out[rs, ts] = step[rs]
    return out


@dataclass
class Stopping:
    """generate()'s stopping criteria as the decoding loop applies them (``split_criteria``).

    ``eos``: the ids of the EOS criteria [E] (None: none), checked per row, vectorized;
    ``max_length``: the smallest max_length of the length criteria (they stop every row at the same
    length, so they are a per-row budget); ``time_limits``: time limits, which stop the whole batch at once;
    ``criteria``: the others, called at every length a row reaches (``first_stop``); ``pads``: rows
    a criterion stopped are finished and padded, as standard decoding does when any criterion has
    an ``eos_token_id`` attribute (otherwise they keep generating until every row has stopped).
    """

    eos: torch.Tensor | None
    max_length: int | None
    time_limits: list
    criteria: StoppingCriteriaList
    pads: bool


def split_criteria(criteria) -> Stopping:
    """Sort the criteria generate() built (its defaults merged with the ones passed, as it merges
    them) by how decoding applies them. Only criteria that run Transformers' own code for EOS, max
    length and max time are taken apart; subclasses with code of their own are called as any criterion."""
    eos, lengths, time_limits, rest = [], [], [], StoppingCriteriaList()
    for c in criteria:
        kind = behaves_as(c, (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria))
        if kind is EosTokenCriteria:
            eos.append(c.eos_token_id.reshape(-1))
        elif kind is MaxLengthCriteria:
            lengths.append(c.max_length)
        elif kind is MaxTimeCriteria:
            time_limits.append(c)
        else:
            rest.append(c)
    return Stopping(torch.cat(eos).unique() if eos else None, min(lengths, default=None), time_limits, rest,
                    pads=any(hasattr(c, "eos_token_id") for c in criteria))


class ScoreHistory:
    """The processed scores of the positions each row has committed: the ``scores`` tuple standard
    decoding hands the stopping criteria when it returns scores (``return_dict_in_generate`` and
    ``output_scores``), one [B, V] float32 tensor per step so far.

    Entry s of row r holds the scores that chose row r's token s (the prefill's or a verify pass's
    processed scores, which are standard decoding's for that row and step). Rows stand at different
    lengths, and a criterion is called at a length with only the rows there keeping its answer
    (``first_stop``), so the other rows' entries may hold another step's scores or zeros: as for
    processors, a criterion computes each row from its own ``input_ids`` and scores.
    """

    def __init__(self, steps: int, batch: int, vocab: int, prompt_len: int, device):
        self.buffer = torch.zeros(steps, batch, vocab, dtype=torch.float32, device=device)  # entry s: buffer[s] [B, V]
        self.prompt_len = prompt_len

    def record(self, rows, gen: list[int], scores: torch.Tensor, live: list[bool] | None = None) -> None:
        """Rows ``rows`` (index tensor [n]) at ``gen`` generated tokens: their ``scores`` [n, q, V]
        for steps gen .. gen + q - 1 (those past the last step are dropped); ``live``: the rows to
        record (default all)."""
        n, q, _ = scores.shape
        device = scores.device
        steps = torch.tensor(gen, device=device)[:, None] + torch.arange(q, device=device)
        keep = steps < self.buffer.shape[0]
        if live is not None:
            keep &= torch.tensor(live, device=device)[:, None]
        self.buffer[steps[keep], rows.to(device)[:, None].expand(n, q)[keep]] = scores[keep]

    def __call__(self, length: int) -> tuple:
        """The tuple a criterion is handed at batch length ``length``."""
        return tuple(self.buffer[: length - self.prompt_len].unbind(0))


def reads_scores(criteria) -> bool:
    """Whether some criterion may read ``scores`` (Transformers' stop-string criterion does not)."""
    return any(behaves_as(c, (StopStringCriteria,)) is None for c in criteria)


def step_outputs(processors, sequences: torch.Tensor, prompt_len: int, logits: torch.Tensor, scores: bool):
    """Standard decoding's returned (scores, logits): ``logits`` [S, B, V] float32, the raw logits of
    every row at each of the S steps (finished rows fed the pad token, as there). Step s calls the
    processors once with the whole batch's first ``prompt_len + s`` tokens and that step's logits,
    as standard decoding's step does, and keeps what they return as its scores (``scores``: whether
    they are asked for). Returns (scores tuple or None, logits tuple), one [B, V] tensor per step."""
    raw = logits.unbind(0)  # contiguous [B, V] each
    if not scores:
        return None, raw
    return tuple(processors(sequences[:, : prompt_len + s].clone(), step) for s, step in enumerate(raw)), raw


def expired(time_limits: list, tokens: torch.Tensor) -> bool:
    """Whether a time limit has passed (it answers for the whole batch, as at a standard decoding step)."""
    return any(bool(c(tokens, None).any()) for c in time_limits)


def first_stop(criteria: StoppingCriteriaList, tokens: torch.Tensor, plen: list[int], gen: list[int],
               counts: list[int], scores=None) -> list[int | None]:
    """For rows committing ``counts[b]`` tokens after their ``plen[b] + gen[b]``: the number kept up
    to and including the first token that stops the row, or None if none does.

    The criteria see the whole batch's first L tokens for each length L a row reaches, as at
    standard decoding's step of that length, and ``scores``: None, as there unless scores are
    returned, or then a ``ScoreHistory`` (the tuple of the steps' processed scores so far).
    """
    stop = [None] * len(gen)
    lengths = {}
    for r, (p, g, c) in enumerate(zip(plen, gen, counts)):
        for j in range(c):
            lengths.setdefault(p + g + j + 1, []).append((r, j))
    for length, at in sorted(lengths.items()):
        pending = [(r, j) for r, j in at if stop[r] is None]
        if not pending:
            continue
        hit = criteria(tokens[:, :length], None if scores is None else scores(length)).tolist()
        for r, j in pending:
            if hit[r]:
                stop[r] = j + 1
    return stop
