"""The InvisibleLoRA decoding loop: prefill, then cycles of draft -> verify -> accept -> commit.

``Rows.tokens`` [B, W]: slot j of row b holds token j of that row (layout.py): the prompt at
0..P-1, then the row's generated tokens, ``gen[b]`` of them committed. Cache slot j holds token
j's key/value (cache.py), so the last committed token ``tokens[b, P + gen[b] - 1]`` is the only
committed token not yet cached, and it is where each cycle starts:

    draft   (LoRA off, k passes of 1 token): d_1..d_k written to tokens[P+gen .. P+gen+k-1]
            and their speculative KV to the same slots - 1
    verify  (LoRA on, 1 pass of k+1 tokens): [last, d_1..d_k] at slots P+gen-1 .., overwriting
            the draft KV with LoRA-on KV; target scores for k+1 positions
    accept  n drafts per row (acceptance.py), plus one target token
    commit  cut at EOS / stopping criteria / max length; gen += kept

The host learns each row's counts once per cycle (one device sync); everything else is batched.
Passes go through a forward object (forward.py): ``fwd(ids, start, kv_len, keep, lora_on)``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from .acceptance import accept_greedy, accept_sampling, sample
from .gate import Gate
from .processors import first_stop, process_scores, split_criteria
from .stats import DecodingStats


@dataclass
class Rows:
    """The rows of one call: their tokens and how far each has got.

    ``gen`` / ``done`` live on the device for batched ops; ``gen_h`` / ``done_h`` are their host
    copies, refreshed by the cycle's one sync. ``stop_at[b]``: the number of tokens at which a
    stopping criterion stopped row b when finished rows are not frozen (no EOS: standard decoding
    then keeps generating real tokens for them until every row has stopped).
    """

    tokens: torch.Tensor
    prompt_len: int
    max_new: int
    gen: torch.Tensor
    done: torch.Tensor
    gen_h: list
    done_h: list
    stop_at: list

    @classmethod
    def start(cls, input_ids: torch.Tensor, max_new: int, width: int, pad_id: int) -> "Rows":
        b, p = input_ids.shape
        tokens = input_ids.new_full((b, width), pad_id, dtype=torch.long)
        tokens[:, :p] = input_ids
        gen = tokens.new_zeros(b)
        return cls(tokens, p, max_new, gen, torch.zeros(b, dtype=torch.bool, device=tokens.device), [0] * b,
                   [False] * b, [None] * b)

    @property
    def active(self) -> list[int]:
        return [r for r, d in enumerate(self.done_h) if not d]

    def ends(self) -> torch.Tensor:
        """[B] slot after each row's last committed token."""
        return self.prompt_len + self.gen


def draft(fwd, rows: Rows, k: int, processors, do_sample: bool, generator):
    """k LoRA-off passes of one token per row; returns drafts [B, k] and their probabilities [B, k, V] (sampling).

    Each draft is written into ``rows.tokens`` at once: the next draft step and the processors read it there.
    """
    last = rows.ends() - 1
    x = rows.tokens.gather(1, last[:, None])
    drafts, probs = [], []
    for j in range(k):
        logits = fwd(x, last + j, rows.prompt_len + max(rows.gen_h) + j, keep=1, lora_on=False)
        lengths = [rows.prompt_len + g + j for g in rows.gen_h]
        scores = process_scores(processors, rows.tokens, lengths, logits, rows.active)[:, 0]
        if do_sample:
            d, q = sample(scores, generator)
            probs.append(q)
        else:
            d = scores.argmax(-1)
        rows.tokens.scatter_(1, (last + 1 + j)[:, None], d[:, None])
        drafts.append(d)
        x = d[:, None]
    if not drafts:  # k = 0: a plain step follows
        return rows.tokens.new_zeros(rows.tokens.shape[0], 0), None
    return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)


def verify(fwd, rows: Rows, k: int, processors):
    """One LoRA-on pass over [last, d_1..d_k] per row; returns processed target scores [B, k+1, V]."""
    start = rows.ends() - 1
    ids = rows.tokens.gather(1, start[:, None] + torch.arange(k + 1, device=start.device))
    logits = fwd(ids, start, rows.prompt_len + max(rows.gen_h) + k, keep=k + 1)
    lengths = [rows.prompt_len + g for g in rows.gen_h]
    return process_scores(processors, rows.tokens, lengths, logits, rows.active)


def accept(drafts, draft_probs, target_scores, do_sample, generator):
    if do_sample:
        return accept_sampling(drafts, draft_probs, target_scores, generator)
    return accept_greedy(drafts, target_scores)


def commit(rows: Rows, n, next_token, k: int, eos, criteria, freeze: bool):
    """Append each active row's accepted drafts + next token, cut at EOS / stopping criteria / max length.

    ``freeze``: a stopped row is finished (its later tokens are padding), as in standard decoding
    when an EOS token is set; otherwise it keeps generating until every row has stopped.
    Returns the host lists (kept per row, accepted drafts per row): the cycle's one device sync
    (two when stopping criteria beyond EOS / max length are set).
    """
    tokens, p, gen = rows.tokens, rows.prompt_len, rows.gen
    tokens.scatter_(1, (p + gen + n)[:, None], next_token[:, None])
    kept = torch.where(rows.done, 0, n + 1).clamp_(max=rows.max_new - gen)
    stopped = torch.zeros_like(rows.done)
    if eos is not None:
        offsets = torch.arange(k + 1, device=tokens.device)
        new = tokens.gather(1, p + gen[:, None] + offsets)
        is_eos = torch.isin(new, eos) & (offsets < kept[:, None])
        stopped = is_eos.any(1)
        kept = torch.where(stopped, is_eos.long().argmax(1) + 1, kept)
    kept_h, stopped_h, n_h = torch.stack([kept, stopped.long(), n]).tolist()
    if criteria:
        for r, s in enumerate(first_stop(criteria, tokens, p, rows.gen_h, kept_h)):
            if s is not None:
                kept_h[r], stopped_h[r] = s, 1
    for r in range(len(kept_h)):
        rows.gen_h[r] += kept_h[r]
        if stopped_h[r] and rows.stop_at[r] is None:
            rows.stop_at[r] = rows.gen_h[r]
    if freeze or None in rows.stop_at:
        limit = [rows.max_new] * len(kept_h)
    else:  # every row has stopped: all generate up to the last one's stop, as standard decoding does
        limit = [max(rows.stop_at)] * len(kept_h)
    rows.done_h = [g >= lim or bool(freeze and s is not None) for g, lim, s in zip(rows.gen_h, limit, rows.stop_at)]
    rows.gen = torch.tensor(rows.gen_h, device=tokens.device)
    rows.done = torch.tensor(rows.done_h, device=tokens.device)
    return kept_h, n_h


def output_length(rows: Rows, freeze: bool) -> int:
    """New tokens in the output: as many as standard decoding's steps."""
    if not freeze and None not in rows.stop_at:
        return min(max(rows.stop_at), rows.max_new)
    return max(rows.gen_h)


def run(input_ids, fwd, processors, stopping_criteria, config, *, max_draft_tokens: int, gate: Gate,
        streamer=None, generator=None, stats: DecodingStats, recompute=None) -> tuple[torch.Tensor, Rows]:
    """Decode ``input_ids`` [B, P] to ``config.max_length``; returns (sequences [B, P + new], rows).

    ``recompute``: a rotary.Recompute when standard decoding recomputes its cache at some slot.
    """
    b, prompt_len = input_ids.shape
    device = input_ids.device
    max_new = config.max_length - prompt_len
    do_sample = bool(config.do_sample)
    pad_id = int(config._pad_token_tensor) if config._pad_token_tensor is not None else 0
    eos = config._eos_token_tensor
    eos = eos.reshape(-1).to(device) if eos is not None else None
    freeze = eos is not None  # standard decoding pads finished rows only when an EOS criterion exists
    criteria = split_criteria(stopping_criteria)
    rows = Rows.start(input_ids, max_new, prompt_len + max_new + max_draft_tokens + 1, pad_id)
    drafted, accepted, row_cycles = [0] * b, [0] * b, [0] * b
    timer = PassTimer(device)

    # Prefill: the prompt with LoRA on; its last position gives the first token (a verify of k = 0).
    logits = fwd(input_ids, input_ids.new_zeros(b), prompt_len, keep=1, prefix=prompt_len)
    scores = process_scores(processors, rows.tokens, [prompt_len] * b, logits)
    drafts, draft_probs, k = rows.tokens.new_zeros(b, 0), None, 0
    builds = fwd.builds
    while True:
        n, next_token = accept(drafts, draft_probs, scores, do_sample, generator)
        if recompute is not None:
            n, next_token = recompute.cap(rows, n, next_token, drafts)
        active = rows.active
        kept_h, n_h = commit(rows, n, next_token, k, eos, criteria, freeze)
        for r in active:
            drafted[r] += k
            accepted[r] += n_h[r]
            row_cycles[r] += 1
        spans = timer.collect()
        if "verify" in spans and fwd.builds == builds:  # not after the prefill, nor a pass's compilation
            gate.observe(k, n_h, [r in active for r in range(b)], spans.get("draft"), spans["verify"])
        if streamer is not None and kept_h[0]:
            end = prompt_len + rows.gen_h[0]
            streamer.put(rows.tokens[0, end - kept_h[0] : end].cpu())
        if all(rows.done_h):
            break

        k = gate.choose([0 if d else max_new - g for g, d in zip(rows.gen_h, rows.done_h)])
        stats.cycles += 1
        stats.k_per_cycle.append(k)
        stats.draft_passes += k
        builds = fwd.builds
        with timer("draft"):
            drafts, draft_probs = draft(fwd, rows, k, processors, do_sample, generator)
        if recompute is not None:
            recompute.before_verify(fwd, rows)
        with timer("verify"):
            scores = verify(fwd, rows, k, processors)

    if streamer is not None:
        streamer.end()
    new = output_length(rows, freeze)
    stats.drafted, stats.accepted = drafted, accepted
    stats.committed = [min(g, new) for g in rows.gen_h]
    stats.row_cycles = [c - 1 for c in row_cycles]  # the prefill is not a cycle
    stats.cache_bytes = fwd.cache.nbytes
    sequences = rows.tokens[:, : prompt_len + new].clone()
    past_end = torch.arange(sequences.shape[1], device=device) >= (prompt_len + rows.gen)[:, None]
    return sequences.masked_fill_(past_end, pad_id), rows


class PassTimer:
    """Wall time of model passes without extra device syncs: CUDA events are read after the
    cycle's own sync (``collect``); on the CPU, passes are synchronous, so a clock is exact."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans[name] = [start, end]
        else:
            t = time.perf_counter()
            yield
            self.spans[name] = [t, time.perf_counter()]

    def collect(self) -> dict[str, float]:
        """Seconds per pass since the last collect (call after the cycle's device sync)."""
        if self.cuda:
            out = {k: s.elapsed_time(e) / 1000 for k, (s, e) in self.spans.items()}
        else:
            out = {k: e - s for k, (s, e) in self.spans.items()}
        self.spans = {}
        return out
