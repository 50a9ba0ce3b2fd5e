"""The InvisibleLoRA decoding loop: prefill, then cycles of draft -> verify -> accept -> commit.

Token buffer ``tokens`` [B, P + max_new + K + 1]: the (left-padded) prompt at 0..P-1, then each
row's generated tokens; ``gen[b]`` of them are committed. Cache slot j holds token j's key/value
(see cache.py), so the last committed token ``tokens[b, P + gen[b] - 1]`` is the only committed
token not yet in the cache, and it is where each cycle starts:

    draft   (LoRA off, k passes of 1 token): d_1..d_k written to tokens[P+gen .. P+gen+k-1]
            and their speculative KV to the same slots - 1
    verify  (LoRA on, 1 pass of k+1 tokens): [last, d_1..d_k] at slots P+gen-1 .., overwriting
            the draft KV with LoRA-on KV; target scores for k+1 positions
    accept  n drafts per row (acceptance.py), plus one target token
    commit  cut at EOS / stopping criteria / max length; gen += kept

The host learns each row's counts once per cycle (one device sync); everything else is batched.
Passes go through a forward object: ``EagerForward`` here, or ``compiled.CompiledForward`` (fixed
shapes, compiled per bucket), with the same call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import accept_greedy, accept_sampling, sample
from .cache import HybridCache, model_pass
from .gate import Gate, PassTimer
from .ragged import first_stop, process_scores, split_criteria
from .stats import DecodingStats


@dataclass
class InvisibleLoRAOutput(GenerateDecoderOnlyOutput):
    """``generate(..., return_dict_in_generate=True)`` output: ``sequences`` plus ``stats``."""

    stats: DecodingStats | None = None


class EagerForward:
    """Passes as they come: the batch as it is, attending to the first ``kv_len`` cache slots."""

    builds = 0  # passes compiled during the call: none

    def __init__(self, model, lora, pad, max_len: int):
        self.model, self.lora = model, lora
        self.cache = HybridCache(model.config, pad, max_len)

    def __call__(self, ids, start, kv_len: int, keep: int, lora_on: bool = True):
        """One pass over ``ids`` [B, q] written at cache slots ``start`` [B]..; logits [B, keep, V]."""
        if lora_on:
            self.lora.on(ids.shape[1])
        else:
            self.lora.off()
        return model_pass(self.model, self.cache, ids, start, kv_len, keep)


def draft(fwd, tokens, gen, gen_h, prompt_len, k, processors, do_sample, generator):
    """k LoRA-off passes of one token per row; returns drafts [B, k] and their probabilities [B, k, V] (sampling).

    Each draft is written into ``tokens`` at once: the next draft step and the logits processors read it there.
    """
    last = prompt_len + gen - 1
    x = tokens.gather(1, last[:, None])
    drafts, probs = [], []
    for j in range(k):
        logits = fwd(x, last + j, prompt_len + max(gen_h) + j, keep=1, lora_on=False)
        scores = process_scores(processors, tokens, [prompt_len + g + j for g in gen_h], logits)[:, 0]
        if do_sample:
            d, q = sample(scores, generator)
            probs.append(q)
        else:
            d = scores.argmax(-1)
        tokens.scatter_(1, (prompt_len + gen + j)[:, None], d[:, None])
        drafts.append(d)
        x = d[:, None]
    if not drafts:  # k = 0: a plain step follows
        return tokens.new_zeros(tokens.shape[0], 0), None
    return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)


def verify(fwd, tokens, gen, gen_h, prompt_len, k, processors):
    """One LoRA-on pass over [last, d_1..d_k] per row; returns processed target scores [B, k+1, V]."""
    start = prompt_len + gen - 1
    ids = tokens.gather(1, start[:, None] + torch.arange(k + 1, device=tokens.device))
    logits = fwd(ids, start, prompt_len + max(gen_h) + k, keep=k + 1)
    return process_scores(processors, tokens, [prompt_len + g for g in gen_h], logits)


def accept(drafts, draft_probs, target_scores, do_sample, generator):
    if do_sample:
        return accept_sampling(drafts, draft_probs, target_scores, generator)
    return accept_greedy(drafts, target_scores)


def commit(tokens, gen, done, n, next_token, k, prompt_len, max_new, eos, criteria, pad_id):
    """Append each active row's accepted drafts + next token, cut at EOS / stopping criteria / max length.

    Returns (kept [B], done [B], and kept, done, n as host lists): the host learns them here,
    the cycle's one device sync (two when stopping criteria beyond EOS / max length are set).
    """
    tokens.scatter_(1, (prompt_len + gen + n)[:, None], next_token[:, None])
    kept = torch.where(done, 0, n + 1).clamp_(max=max_new - gen)
    if eos is not None:
        offsets = torch.arange(k + 1, device=tokens.device)
        new = tokens.gather(1, prompt_len + gen[:, None] + offsets)
        is_eos = torch.isin(new, eos) & (offsets < kept[:, None])
        hit = is_eos.any(1)
        kept = torch.where(hit, is_eos.long().argmax(1) + 1, kept)
        done = done | hit
    done = done | (gen + kept >= max_new)
    kept_h, done_h, n_h = torch.stack([kept, done.long(), n]).tolist()
    if criteria:
        kept, stopped = first_stop(criteria, tokens, prompt_len + gen + kept, kept_h, pad_id)
        done = done | stopped
        kept_h, done_h = torch.stack([kept, done.long()]).tolist()
    return kept, done, kept_h, done_h, n_h


def run(input_ids, attention_mask, new_forward, processors, stopping_criteria, config, *, max_draft_tokens,
        gate: Gate, streamer=None, generator=None, stats: DecodingStats):
    """Decode ``input_ids`` [B, P] (left-padded) to ``config.max_length``; returns sequences [B, P + new].

    ``new_forward(pad, max_len)`` makes the forward object (EagerForward's call) for a cache of
    ``max_len`` slots per row with ``pad`` [B] left padding.
    """
    b, prompt_len = input_ids.shape
    device = input_ids.device
    max_new = config.max_length - prompt_len
    do_sample = bool(config.do_sample)
    pad_id = int(config._pad_token_tensor) if config._pad_token_tensor is not None else 0
    eos = config._eos_token_tensor
    eos = eos.reshape(-1).to(device) if eos is not None else None
    criteria = split_criteria(stopping_criteria)
    pad = (attention_mask == 0).sum(1) if attention_mask is not None else input_ids.new_zeros(b)

    tokens = input_ids.new_full((b, prompt_len + max_new + max_draft_tokens + 1), pad_id)
    tokens[:, :prompt_len] = input_ids
    fwd = new_forward(pad, prompt_len + max_new + max_draft_tokens)
    builds = fwd.builds
    gen = input_ids.new_zeros(b)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    drafted, accepted, row_cycles = gen.clone(), gen.clone(), gen.clone()
    gen_h, done_h = [0] * b, [False] * b
    timer = PassTimer(device)

    # Prefill: the prompt with LoRA on; its last position gives the first token (a verify of k = 0).
    logits = fwd(input_ids, input_ids.new_zeros(b), prompt_len, keep=1)
    scores = process_scores(processors, tokens, [prompt_len] * b, logits)
    drafts, draft_probs, k = tokens.new_zeros(b, 0), None, 0
    while True:
        n, next_token = accept(drafts, draft_probs, scores, do_sample, generator)
        active, active_h = ~done, [not d for d in done_h]
        drafted += active * k
        row_cycles += active
        accepted += active * n
        kept, done, kept_h, done_h, n_h = commit(
            tokens, gen, done, n, next_token, k, prompt_len, max_new, eos, criteria, pad_id
        )
        spans = timer.collect()
        if "verify" in spans and fwd.builds == builds:  # not after the prefill, nor a pass's compilation
            gate.observe(k, n_h, active_h, spans.get("draft"), spans["verify"])
        if streamer is not None and kept_h[0]:
            streamer.put(tokens[0, prompt_len + gen_h[0] : prompt_len + gen_h[0] + kept_h[0]].cpu())
        gen += kept
        gen_h = [g + c for g, c in zip(gen_h, kept_h)]
        if all(done_h):
            break

        k = gate.choose([0 if d else max_new - g for g, d in zip(gen_h, done_h)])
        stats.cycles += 1
        stats.k_per_cycle.append(k)
        stats.draft_passes += k
        builds = fwd.builds
        with timer("draft"):
            drafts, draft_probs = draft(fwd, tokens, gen, gen_h, prompt_len, k, processors, do_sample, generator)
        with timer("verify"):
            scores = verify(fwd, tokens, gen, gen_h, prompt_len, k, processors)

    if streamer is not None:
        streamer.end()
    stats.drafted, stats.accepted, stats.committed = drafted.tolist(), accepted.tolist(), gen_h
    stats.row_cycles = (row_cycles - 1).tolist()  # the prefill is not a cycle
    stats.cache_bytes = sum(x.keys.nbytes + x.values.nbytes for x in fwd.cache.layers if x.is_initialized)
    sequences = tokens[:, : prompt_len + max(gen_h)].clone()
    past_end = torch.arange(sequences.shape[1], device=device) >= (prompt_len + gen)[:, None]
    return sequences.masked_fill_(past_end, pad_id)
