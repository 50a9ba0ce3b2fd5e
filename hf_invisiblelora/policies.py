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
from transformers.generation import logits_process as lp

from .acceptance import accept_greedy, accept_sampling, sample
from .processors import process_scores

# Temperatures below this decode greedily, as in vLLM (its _SAMPLING_EPS). The sample is
# argmax(logits / T + g), with Gumbel noise g that _gumbel's clamp bounds to [-3.9, 16.2]: below 1e-5
# only a token within 20 T (< 2e-4) of the top logit could win instead, and far smaller T overflow
# float32 (at T = 1e-40, logits / T is inf, then NaN: an empty answer).
GREEDY_BELOW = 1e-5


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


class RequestPolicy:
    """Each row its own request (engine.py): greedy (temperature 0) or sampled with its temperature,
    top-k and top-p, applied as generate() applies them (Transformers' warpers, in its order).

    Sampling is greedy decoding on log-probabilities plus Gumbel noise: with g_i the noise drawn for
    generated position i from the request's seed, the token at i is argmax(log p_i + g_i), an exact
    sample from p_i (the Gumbel-max trick). The drafter's picks use the same noise, so drafts are
    accepted when they equal the target's pick, and the output depends only on the request: not on
    its batch mates, nor on how many tokens the gate drafted.
    """

    def __init__(self, capacity: int, device):
        self.device = device
        self.settings = [None] * capacity  # (temperature, top_k, top_p) per row
        self.generators = [None] * capacity
        self.noise = [{} for _ in range(capacity)]  # row -> {generated position: Gumbel noise [V]}
        self.drawn = [0] * capacity  # positions drawn so far, in order: noise i is the i-th draw

    def set_request(self, r: int, request) -> None:
        temperature = request.temperature if request.temperature >= GREEDY_BELOW else 0.0
        self.settings[r] = (temperature, request.top_k, request.top_p)
        seed = request.seed if request.seed is not None else int(torch.randint(2**62, ()).item())
        self.generators[r] = torch.Generator(device=self.device).manual_seed(seed)
        self.noise[r], self.drawn[r] = {}, 0

    def release(self, r: int) -> None:
        """Forget row r's request (its settings, generator and noise); the next one sets its own."""
        self.settings[r], self.generators[r], self.noise[r], self.drawn[r] = None, None, {}, 0

    def _gumbel(self, r: int, position: int, vocab: int):
        noise = self.noise[r]
        while self.drawn[r] <= position:
            u = torch.rand(vocab, generator=self.generators[r], device=self.device).clamp_(min=1e-20, max=1 - 1e-7)
            noise[self.drawn[r]] = -torch.log(-torch.log(u))
            self.drawn[r] += 1
        return noise[position]

    def scores(self, rows, which, logits, offset: int):
        idx = _idx(rows, which)
        scores = logits.float()
        n, q, v = scores.shape
        groups = {}
        for i, r in enumerate(idx):
            if not rows.done_h[r] and self.settings[r] is not None and self.settings[r][0] > 0:
                groups.setdefault(self.settings[r], []).append(i)
        for (temperature, top_k, top_p), members in groups.items():
            warpers = [lp.TemperatureLogitsWarper(temperature)]
            if top_k:
                warpers.append(lp.TopKLogitsWarper(top_k))
            if top_p < 1:
                warpers.append(lp.TopPLogitsWarper(top_p))
            sub = scores[members].reshape(-1, v)
            for w in warpers:
                sub = w(None, sub)
            sub = sub.log_softmax(-1).reshape(len(members), q, v)
            for j, i in enumerate(members):
                r = idx[i]
                start = rows.gen_h[r] + offset
                self.noise[r] = {p: g for p, g in self.noise[r].items() if p >= rows.gen_h[r]}  # committed: not needed
                sub[j] += torch.stack([self._gumbel(r, start + t, v) for t in range(q)])
            scores[members] = sub
        return scores

    def pick(self, scores, rows, which, offset: int):
        return scores.argmax(-1), None

    def accept(self, drafts, draft_probs, scores, rows, which):
        return accept_greedy(drafts, scores)
