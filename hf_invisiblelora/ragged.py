"""generate()'s logits processors and stopping criteria, applied to rows of different lengths.

Transformers calls them with ``input_ids`` [B, L], every row the same length. Here rows commit
different numbers of tokens per cycle, so each row's context is ``tokens[b, :lengths[b]]`` of a
left-aligned token buffer. Processors that look only at the scores run once over all rows and
positions; the others (repetition penalty, min length, ...) run once per group of equal-length rows
with exactly the ``input_ids`` standard decoding would give them, so draft and target scores are
processed as standard decoding would process them.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

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
)
# Processors holding per-row tensors (indexed like the batch): subset them along with the rows.
_PER_ROW_STATE = {lp.RepetitionPenaltyLogitsProcessor: ("prompt_ignore_length",)}


def _for_rows(processor, rows: torch.Tensor, batch: int):
    attrs = [a for a in _PER_ROW_STATE.get(type(processor), ()) if isinstance(getattr(processor, a), torch.Tensor)]
    if not attrs or len(rows) == batch:
        return processor
    processor = copy.copy(processor)
    for a in attrs:
        setattr(processor, a, getattr(processor, a).to(rows.device)[rows])
    return processor


def process_scores(processors, tokens: torch.Tensor, lengths: list[int], scores: torch.Tensor) -> torch.Tensor:
    """Apply ``processors`` to ``scores`` [B, q, V]: position t of row b follows ``tokens[b, :lengths[b] + t]``."""
    if not processors:
        return scores
    b, q, v = scores.shape
    if all(isinstance(p, _SCORES_ONLY) for p in processors):
        flat = scores.reshape(b * q, v)
        ids = tokens[:1, :1].expand(b * q, 1)  # unread by these processors
        for p in processors:
            flat = p(ids, flat)
        return flat.reshape(b, q, v)
    out = torch.empty_like(scores)
    for t in range(q):
        groups = defaultdict(list)
        for row, n in enumerate(lengths):
            groups[n + t].append(row)
        for n, rows in groups.items():
            idx = torch.tensor(rows, device=scores.device)
            s = scores[idx, t]
            for p in processors:
                s = _for_rows(p, idx, b)(tokens[idx, :n], s)
            out[idx, t] = s
    return out


def split_criteria(criteria) -> list:
    """The criteria decoding must call itself; max length and EOS are handled per row, vectorized."""
    return [c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]


def first_stop(criteria, tokens: torch.Tensor, ends: torch.Tensor, counts: list[int], pad: int):
    """For rows that commit ``counts[b]`` tokens ending at ``ends[b]`` (exclusive): how many to keep.

    Criteria look at the end of ``input_ids``, so each row's prefix is shown right-aligned
    (left-filled with ``pad``). Returns ([B] counts cut after the first token that stops a row,
    [B] bool: the row stopped).
    """
    keep = torch.tensor(counts, device=tokens.device)
    stopped = torch.zeros_like(keep, dtype=torch.bool)
    if not criteria or max(counts) == 0:
        return keep, stopped
    start = ends - keep
    for j in range(max(counts)):
        end = start + j + 1  # row prefix after its (j+1)-th new token
        width = int(end.max())
        col = end[:, None] - width + torch.arange(width, device=tokens.device)
        view = torch.where(col >= 0, tokens.gather(1, col.clamp(min=0)), pad)
        hit = torch.zeros_like(stopped)
        for c in criteria:
            hit |= c(view, None).to(hit.device)
        hit &= ~stopped & (j < keep)
        keep = torch.where(hit, j + 1, keep)
        stopped |= hit
    return keep, stopped
