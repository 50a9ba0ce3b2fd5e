"""How tokens are chosen: a decoder's policy processes the logits of a pass, picks draft tokens and
accepts drafts against the target (decoding.py calls it; which rows: a slice of the first rows, or
the row indices of a prefill).

- ``GeneratePolicy``: standard generate()'s processors over the batch (processors.py), greedy or
  speculative sampling with one generator (acceptance.py).
- ``RequestPolicy``: each row a request of its own (engine.py): its temperature / top-p / top-k,
  greedy or seeded sampling whose output depends only on the request (not on its batch mates or
  on how many tokens were drafted): sampling is the argmax of log-probabilities plus Gumbel noise
  drawn per token position from the request's seed (the Gumbel-max trick), so drafts and the
  target are compared as in greedy decoding, and each committed token is an exact sample.
"""

from __future__ import annotations

import torch

from .acceptance import accept_greedy, accept_sampling, sample
from .processors import process_scores


def _idx(rows, which) -> list[int]:
    """The row indices a pass runs: the first rows (a slice) or some (an index tensor)."""
    return list(range(*which.indices(len(rows.plen_h)))) if isinstance(which, slice) else which.tolist()


def _lengths(rows, idx, offset: int) -> list[int]:
    """The length of each row's context before position 0 of a pass (``offset`` drafts into a cycle)."""
    return [rows.plen_h[r] + rows.gen_h[r] + offset for r in idx]


class GeneratePolicy:
    """generate()'s processors and decoding mode for a batch whose rows all start together."""

    def __init__(self, processors, do_sample: bool, generator=None):
        self.processors, self.do_sample, self.generator = processors, do_sample, generator

    def load(self, idx) -> None:
        pass

    def scores(self, rows, which, logits, offset: int):
        idx = _idx(rows, which)
        active = [i for i, r in enumerate(idx) if not rows.done_h[r]]
        return process_scores(self.processors, rows.tokens[which], _lengths(rows, idx, offset), logits, active)

    def pick(self, scores, rows, which, offset: int):
        if self.do_sample:
            return sample(scores, self.generator)
        return scores.argmax(-1), None

    def accept(self, drafts, draft_probs, scores, rows, which):
        if self.do_sample:
            return accept_sampling(drafts, draft_probs, scores, self.generator)
        return accept_greedy(drafts, scores)
