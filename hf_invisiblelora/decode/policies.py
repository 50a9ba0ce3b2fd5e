"""How tokens are chosen: a decoder's policy processes the logits of a pass, picks draft tokens and
accepts drafts against the target (decoder.py calls it; which rows: a slice of the first rows, or
the row indices of a prefill).

- ``GeneratePolicy``: standard generate()'s processors over the batch (processors.py), greedy or
  speculative sampling with one generator (acceptance.py).
- ``RequestPolicy``: each row a request of its own (engine.py): its logit bias, min_tokens,
  repetition, presence and frequency penalties, temperature / top-k / top-p / min-p, greedy or
  seeded sampling whose output depends only on the request (not on its batch mates or on how
  many tokens were drafted): sampling is the argmax of log-probabilities plus Gumbel noise
  drawn per token position from the request's seed (the Gumbel-max trick), so drafts and the
  target are compared as in greedy decoding, and each committed token is an exact sample. It
  also keeps the raw log-probabilities of the prompt tokens for requests that ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation import logits_process as lp

from .acceptance import accept_greedy, accept_sampling, sample
from .grammar import GrammarMask
from .processors import process_scores

# Temperatures below this decode greedily, as in vLLM (its _SAMPLING_EPS). The sample is
# argmax(logits / T + g), with Gumbel noise g that _gumbel's clamp bounds to [-3.9, 16.2]: below 1e-5
# only a token within 20 T (< 2e-4) of the top logit could win instead, and far smaller T overflow
# float32 (at T = 1e-40, logits / T is inf, then NaN: an empty answer).
GREEDY_BELOW = 1e-5


def _idx(batch, which) -> list[int]:
    """The row indices a pass runs: the first rows (a slice) or some (an index tensor)."""
    return list(range(*which.indices(len(batch.rows)))) if isinstance(which, slice) else which.tolist()


def _lengths(batch, idx, offset: int) -> list[int]:
    """The length of each row's context before position 0 of a pass (``offset`` drafts into a cycle)."""
    return [batch.rows[r].end + offset for r in idx]


class GeneratePolicy:
    """generate()'s processors and decoding mode for a batch whose rows all start together."""

    def __init__(self, processors, do_sample: bool, generator=None):
        self.processors, self.do_sample, self.generator = processors, do_sample, generator

    def scores(self, batch, which, logits, offset: int, target: bool = False):
        idx = _idx(batch, which)
        active = [i for i, r in enumerate(idx) if batch.rows[r].decoding]
        return process_scores(self.processors, batch.tokens[which], _lengths(batch, idx, offset), logits, active)

    def pick(self, scores, batch, which, offset: int):
        if self.do_sample:
            return sample(scores, self.generator)
        return scores.argmax(-1), None

    def wants_prompt(self, idx) -> bool:
        return False  # generate() returns no prompt log-probabilities

    def accept(self, drafts, draft_probs, scores, batch, which):
        """``draft_probs`` None with drafts: they are point masses (a drafter that proposes tokens, not
        distributions: prompt lookup), q = one-hot."""
        if self.do_sample:
            if draft_probs is None and drafts.shape[1]:
                draft_probs = torch.nn.functional.one_hot(drafts, scores.shape[-1]).to(scores.dtype)
            return accept_sampling(drafts, draft_probs, scores, self.generator)
        return accept_greedy(drafts, scores)


class LogitBias:
    """OpenAI's ``logit_bias``: {token id: bias} added to those tokens' logits (a logits processor)."""

    def __init__(self, bias: dict, device):
        self.ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.values = torch.tensor(list(bias.values()), device=device)

    def __call__(self, input_ids, scores):
        return scores.index_add(-1, self.ids, self.values.to(scores.dtype).expand(*scores.shape[:-1], -1))


class OutputPenalties:
    """OpenAI's (and vLLM's) ``presence_penalty`` and ``frequency_penalty``: each token's logit less
    frequency x its count in the output so far and presence if it occurs there at all. The output:
    ``input_ids`` past the first ``prompt_len`` (a logits processor)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(-1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@dataclass
class RowRequest:
    """One row's request and what its decoding keeps: the processors reading its tokens, its seeded
    generator, the Gumbel noise drawn per generated position (``drawn`` so far, in order: noise i is
    the i-th draw), the raw log-probs kept for its next delivery ((generated position of the first,
    [q, V])), and its prompt tokens' entries so far if it asked (``keep_prompt``). Freeing the row
    drops it all at once."""

    request: object
    processors: list
    generator: torch.Generator
    prompt: list | None = None
    noise: dict = field(default_factory=dict)
    drawn: int = 0
    retained: tuple | None = None


class RequestPolicy:
    """Each row its own request (engine.py): greedy (temperature 0) or sampled, its scores processed
    in vLLM's order: its grammar's mask (structured outputs), the logit bias, no stop token before ``min_tokens``, the repetition penalty (over
    the request's prompt and output; Transformers' processor, as generate() applies it), presence and
    frequency penalties (over the output), then, when sampling, temperature, top-k, top-p and min-p.

    Sampling is greedy decoding on log-probabilities plus Gumbel noise: with g_i the noise drawn for
    generated position i from the request's seed, the token at i is argmax(log p_i + g_i), an exact
    sample from p_i (the Gumbel-max trick). The drafter's picks use the same noise, so drafts are
    accepted when they equal the target's pick, and the output depends only on the request: not on
    its batch mates, nor on how many tokens the gate drafted.

    Log-probabilities (a request's ``logprobs``) are the target's raw ones: the log-softmax of the
    LoRA-on logits before any processing, as vLLM returns by default. A target pass keeps them for
    the rows that asked until their committed tokens are delivered (``token_logprobs``). A
    prefill keeps each prompt token's for the rows that asked (``keep_prompt``, ``prompt``), from
    the logits of the token before it, as vLLM's ``prompt_logprobs``.
    """

    def __init__(self, capacity: int, device):
        self.device = device
        self.rows: list[RowRequest | None] = [None] * capacity  # the request in each row, and its state

    def set_request(self, r: int, request, stops=()) -> None:
        """Row r decodes ``request``; ``stops``: its stop token ids, none generated before min_tokens."""
        procs = []
        if request.grammar is not None:  # the request's stops end its grammar: the output ends with one
            procs.append(GrammarMask(request.grammar, len(request.prompt), stop_tokens=list(stops) or None))
        if request.logit_bias:
            procs.append(LogitBias(request.logit_bias, self.device))
        if request.min_tokens and len(stops):
            procs.append(lp.MinNewTokensLengthLogitsProcessor(len(request.prompt), request.min_tokens, list(stops),
                                                              device=self.device))
        if request.repetition_penalty != 1.0:
            procs.append(lp.RepetitionPenaltyLogitsProcessor(request.repetition_penalty))
        if request.presence_penalty or request.frequency_penalty:
            procs.append(OutputPenalties(len(request.prompt), request.presence_penalty, request.frequency_penalty))
        seed = request.seed if request.seed is not None else int(torch.randint(2**62, ()).item())
        self.rows[r] = RowRequest(request, procs, torch.Generator(device=self.device).manual_seed(seed),
                                  prompt=[None] if request.prompt_logprobs is not None else None)  # the first: none

    def release(self, r: int) -> None:
        """Forget row r's request (its settings, generator and noise); the next one sets its own."""
        self.rows[r] = None

    def prompt_logprobs(self, r: int) -> list | None:
        """Row r's prompt tokens' entries (``keep_prompt``), if its request asked."""
        return self.rows[r].prompt

    def _sampling(self, r: int):
        """(temperature, top_k, top_p, min_p) of a sampled row; None for a greedy one."""
        q = self.rows[r].request
        return (q.temperature, q.top_k, q.top_p, q.min_p) if q.temperature >= GREEDY_BELOW else None

    def _gumbel(self, r: int, position: int, vocab: int):
        row = self.rows[r]
        while row.drawn <= position:
            u = torch.rand(vocab, generator=row.generator, device=self.device).clamp_(min=1e-20, max=1 - 1e-7)
            row.noise[row.drawn] = -torch.log(-torch.log(u))
            row.drawn += 1
        return row.noise[position]

    def scores(self, batch, which, logits, offset: int, target: bool = False):
        idx = _idx(batch, which)
        scores = logits.float()
        n, q, v = scores.shape
        live = [i for i, r in enumerate(idx) if batch.rows[r].decoding and self.rows[r] is not None]
        if target:
            for i in live:
                if self.rows[idx[i]].request.logprobs is not None:
                    self.rows[idx[i]].retained = (batch.rows[idx[i]].gen, scores[i].log_softmax(-1))
        for i in live:
            r, row = idx[i], self.rows[idx[i]]
            if row.processors:  # each position's context: the request's prompt and output before it
                start = batch.rows[r].plen - len(row.request.prompt)
                end = batch.rows[r].end + offset
                scores[i] = torch.cat([_apply(row.processors, batch.tokens[r, start:end + t][None], scores[i, t][None])
                                       for t in range(q)])
        groups = {}
        for i in live:
            if (setting := self._sampling(idx[i])) is not None:
                groups.setdefault(setting, []).append(i)
        for (temperature, top_k, top_p, min_p), members in groups.items():
            warpers = [lp.TemperatureLogitsWarper(temperature)]
            if top_k:
                warpers.append(lp.TopKLogitsWarper(top_k))
            if top_p < 1:
                warpers.append(lp.TopPLogitsWarper(top_p))
            if min_p > 0:
                warpers.append(lp.MinPLogitsWarper(min_p))
            sub = _apply(warpers, None, scores[members].reshape(-1, v)).log_softmax(-1).reshape(len(members), q, v)
            for j, i in enumerate(members):
                r, row = idx[i], self.rows[idx[i]]
                start = batch.rows[r].gen + offset
                row.noise = {p: g for p, g in row.noise.items() if p >= batch.rows[r].gen}  # committed: not needed
                sub[j] += torch.stack([self._gumbel(r, start + t, v) for t in range(q)])
            scores[members] = sub
        return scores

    def token_logprobs(self, r: int, first: int, tokens: list[int], top: int) -> list:
        """Row r's committed ``tokens`` (generated positions first, first + 1, ...): per token its
        raw log-probability and the ``top`` most likely (token id, log-probability) pairs."""
        start, logprobs = self.rows[r].retained
        span = logprobs[first - start : first - start + len(tokens)]
        chosen = span.gather(1, torch.tensor(tokens, device=span.device)[:, None])[:, 0]
        best = span.topk(top, -1) if top else None
        chosen = chosen.tolist()
        if best is None:
            return [(c, []) for c in chosen]
        values, ids = best.values.tolist(), best.indices.tolist()
        return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids, values)]

    def pick(self, scores, batch, which, offset: int):
        return scores.argmax(-1), None

    def wants_prompt(self, idx) -> bool:
        """Whether a row of ``idx`` asks for its prompt's log-probabilities (its prefill keeps every position)."""
        return any(self.rows[r] is not None and self.rows[r].prompt is not None for r in idx)

    def keep_prompt(self, batch, rows, logits, start: int) -> None:
        """From a prefill pass over slots start .. start + q - 1 of ``rows`` (logits [n, q, V]): the
        raw log-probability, rank and top ones of each prompt token whose previous token is in the
        pass, for the rows that asked (``prompt``)."""
        for i, r in enumerate(rows):
            row = self.rows[r]
            entries = None if row is None else row.prompt
            if entries is None:
                continue
            first, end = batch.rows[r].plen - len(row.request.prompt), batch.rows[r].plen
            lo, hi = max(start, first), min(start + logits.shape[1], end - 1)  # slot p predicts token p + 1
            if hi <= lo:
                continue
            logprobs = logits[i, lo - start:hi - start].float().log_softmax(-1)
            tokens = batch.tokens[r, lo + 1:hi + 1]
            chosen = logprobs.gather(1, tokens[:, None])[:, 0]
            ranks = (logprobs > chosen[:, None]).sum(1) + 1
            top = row.request.prompt_logprobs
            best = logprobs.topk(top, -1) if top else None
            for j, (c, rank) in enumerate(zip(chosen.tolist(), ranks.tolist())):
                pairs = list(zip(best.indices[j].tolist(), best.values[j].tolist())) if top else []
                entries.append((c, rank, pairs))

    def accept(self, drafts, draft_probs, scores, batch, which):
        return accept_greedy(drafts, scores)


def _apply(processors, input_ids, scores):
    for p in processors:
        scores = p(input_ids, scores)
    return scores
