"""The InvisibleLoRA decoding loop: prefill, then cycles of draft -> verify -> accept -> commit.

A ``Decoder`` holds rows of one shared cache. ``Batch.tokens`` [C, W]: slot j of row b holds token j
of that row (layout.py): its (left-padded) prompt at 0..plen[b]-1, then its generated tokens,
``gen[b]`` of them committed. Cache slot j holds token j's key/value (cache.py), so the last
committed token ``tokens[b, plen[b] + gen[b] - 1]`` is the only committed token not yet cached,
and it is where each cycle starts:

    draft   (the drafter, drafters.py: the base model with LoRA off, k passes of 1 token):
            d_1..d_k written to tokens[end .. end+k-1] and their speculative KV to the same slots - 1
    verify  (LoRA on, 1 pass of k+1 tokens): [last, d_1..d_k] at slots end-1 .., overwriting
            the draft KV with LoRA-on KV; target scores for k+1 positions
    accept  n drafts per row (the policy's rule), plus one target token
    commit  cut at EOS / stopping criteria / the row's budget; gen += committed

Rows join (``admit``: a prefill of those rows) and leave between cycles; a cycle runs the rows
0..hi-1 that hold work (free rows among them ride along, masked). ``generate()`` admits all its
rows at once and cycles until they are done; the serving engine (engine.py) admits requests as
rows free up. The host learns each row's counts once per cycle (one device sync).

What differs between those uses is the ``policy``: how scores are processed, how a token is
picked from them and how drafts are accepted (greedy, speculative sampling, or per-request
seeded sampling), and its per-row state.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from .gate import Gate
from .processors import expired, first_stop


@dataclass
class Batch:
    """The rows of one cache: their tokens and how far each has got.

    Device tensors for batched ops, host lists (``*_h``) refreshed by each cycle's one sync. A free
    row is done and holds no work. ``stop_at[b]``: the number of tokens at which a stopping
    criterion stopped row b when stopped rows are not frozen (``generate()`` without an EOS token:
    standard decoding then keeps generating real tokens until every row has stopped).
    """

    tokens: torch.Tensor
    plen: torch.Tensor
    gen: torch.Tensor
    plen_h: list
    gen_h: list
    done_h: list
    max_new_h: list
    stop_at: list

    @classmethod
    def empty(cls, capacity: int, width: int, pad_id: int, device) -> "Batch":
        zeros = torch.zeros(capacity, dtype=torch.long, device=device)
        return cls(torch.full((capacity, width), pad_id, dtype=torch.long, device=device), zeros, zeros.clone(),
                   [0] * capacity, [0] * capacity, [True] * capacity, [0] * capacity, [None] * capacity)

    def load(self, idx: list[int], input_ids: torch.Tensor, max_new: list[int]) -> None:
        """Rows ``idx`` start on ``input_ids`` [n, P] (left-padded) with budgets of ``max_new`` tokens."""
        p = input_ids.shape[1]
        self.tokens[idx, :p] = input_ids.to(self.tokens.dtype)
        for r, m in zip(idx, max_new):
            self.plen_h[r], self.gen_h[r], self.done_h[r], self.max_new_h[r], self.stop_at[r] = p, 0, False, m, None
        self.sync()

    def sync(self) -> None:
        """Device copies of the host counts (after the host changed them)."""
        self.plen = torch.tensor(self.plen_h, device=self.tokens.device)
        self.gen = torch.tensor(self.gen_h, device=self.tokens.device)

    @property
    def active(self) -> list[int]:
        return [r for r, d in enumerate(self.done_h) if not d]

    @property
    def hi(self) -> int:
        """Rows 0..hi-1 hold every active row: the span a cycle runs."""
        active = self.active
        return active[-1] + 1 if active else 0

    def ends(self, hi: int) -> torch.Tensor:
        """[hi] slot after each row's last committed token."""
        return self.plen[:hi] + self.gen[:hi]

    def kv_end(self, hi: int, extra: int) -> int:
        """Slots a pass over rows 0..hi-1 attends to when each writes ``extra`` tokens past its end - 1."""
        return max(self.plen_h[r] + self.gen_h[r] for r in range(hi)) - 1 + extra


def verify(fwd, batch: Batch, hi: int, k: int, policy, joining=None):
    """One LoRA-on pass over [last, d_1..d_k] per row of 0..hi-1; returns (processed target scores
    [hi, k+1, V], None). ``joining`` (rows, start, end): the pass also runs those rows' prompt
    slots [start, end) (rows waiting for their prompt: a ragged pass, each row its own tokens; the
    linear layers compute the real ones only), and returns their raw logits at slot end - 1 [n, 1, V]
    second."""
    start = batch.ends(hi) - 1
    if joining is None:
        ids = batch.tokens[:hi].gather(1, start[:, None] + torch.arange(k + 1, device=start.device))
        logits = fwd(ids, start, batch.kv_end(hi, k + 1), keep=k + 1, rows=slice(0, hi))
        return policy.scores(batch, slice(0, hi), logits, offset=0, target=True), None
    rows, lo, end = joining
    span, q, sub = max(hi, max(rows) + 1), max(k + 1, end - lo), torch.tensor(rows, device=start.device)
    starts, lens = start.new_zeros(span), start.new_zeros(span)  # rows hi.. that are not joining: nothing
    starts[:hi], lens[:hi] = start, k + 1
    starts[sub], lens[sub] = lo, end - lo
    at = (starts[:, None] + torch.arange(q, device=start.device)).clamp(max=batch.tokens.shape[1] - 1)
    logits = fwd(batch.tokens[:span].gather(1, at), starts, max(batch.kv_end(hi, k + 1), end), keep=k + 1,
                 rows=slice(0, span), lens=lens)
    return policy.scores(batch, slice(0, hi), logits[:hi], offset=0, target=True), logits[sub, -1:]


def commit(batch: Batch, hi: int, n, next_token, k: int, eos, criteria, freeze: bool, members=None,
           time_limits=(), scores=None):
    """Append each member row's accepted drafts + next token, cut at EOS / stopping criteria / the
    row's budget. ``n``, ``next_token``: [hi]; ``members``: the rows committing (default: the
    active rows among 0..hi-1); the others keep nothing.

    ``freeze``: a stopped row is finished (its later tokens are padding), as in standard decoding
    when a criterion has an ``eos_token_id``; otherwise it keeps generating until every row has
    stopped. ``time_limits``: generate()'s max_time criteria; once one has passed, every row ends at
    one length, as standard decoding's batch ends at the step the time ran out: the shortest length
    a row still generating has reached (rows ahead of it drop what they hold beyond it). ``scores``:
    what the criteria are handed as ``scores`` (None, or a processors.ScoreHistory).
    Returns the host lists (kept per row, accepted drafts per row): the cycle's one device sync
    (two when stopping criteria beyond EOS and the budget are set).
    """
    members = [r for r in range(hi) if not batch.done_h[r]] if members is None else members
    tokens, end = batch.tokens[:hi], batch.ends(hi)
    tokens.scatter_(1, (end + n)[:, None], next_token[:, None])
    member = torch.zeros(hi, dtype=torch.bool, device=tokens.device)
    member[members] = True
    budget = torch.tensor(batch.max_new_h[:hi], device=tokens.device) - batch.gen[:hi]
    committed = torch.where(member, n + 1, 0).minimum(budget)
    stopped = torch.zeros_like(member)
    if eos is not None:
        offsets = torch.arange(k + 1, device=tokens.device)
        new = tokens.gather(1, end[:, None] + offsets)
        hit = torch.isin(new, eos) if eos.dim() == 1 else (new[:, :, None] == eos[:hi, None, :]).any(-1)
        is_eos = hit & (offsets < committed[:, None])
        stopped = is_eos.any(1)
        committed = torch.where(stopped, is_eos.long().argmax(1) + 1, committed)
    committed_h, stopped_h, n_h = torch.stack([committed, stopped.long(), n]).tolist()
    if criteria:
        for r, s in enumerate(first_stop(criteria, tokens, batch.plen_h[:hi], batch.gen_h[:hi], committed_h, scores)):
            if s is not None:
                committed_h[r], stopped_h[r] = s, 1
    for r in members:
        batch.gen_h[r] += committed_h[r]
        if stopped_h[r] and batch.stop_at[r] is None:
            batch.stop_at[r] = batch.gen_h[r]
    if time_limits and expired(time_limits, tokens):
        _end_batch(batch, hi, committed_h, freeze)
        batch.gen = torch.tensor(batch.gen_h, device=tokens.device)
        return committed_h, n_h
    # Without freezing (generate(), whose rows 0..hi-1 are its batch), every row generates up to
    # the last row's stop once all have stopped.
    limit = None if freeze or None in batch.stop_at[:hi] else max(batch.stop_at[:hi])
    for r in members:
        stop = freeze and batch.stop_at[r] is not None
        batch.done_h[r] = stop or batch.gen_h[r] >= (batch.max_new_h[r] if limit is None else limit)
    batch.gen = torch.tensor(batch.gen_h, device=tokens.device)
    return committed_h, n_h


def _end_batch(batch: Batch, hi: int, committed_h: list, freeze: bool) -> None:
    """Every row of 0..hi-1 ends at the shortest length of a row still generating real tokens (rows
    finished and padded do not count); nothing to cut if none is."""
    going = [batch.gen_h[r] for r in range(hi) if not batch.done_h[r] and not (freeze and batch.stop_at[r] is not None)]
    if going:
        end = min(going)
        for r in range(hi):
            committed_h[r] -= max(0, batch.gen_h[r] - end)
            batch.gen_h[r] = min(batch.gen_h[r], end)
            if not freeze:  # the batch's output ends here
                batch.stop_at[r] = end
    for r in range(hi):
        batch.done_h[r] = True


class Decoder:
    """Rows of one shared cache, decoded in cycles (see the module docstring).

    ``fwd``: the forward object (forward.py), ``lora``: the LoRA switch (switch.py), ``policy``:
    processing, picking and acceptance, ``drafter``: what proposes the drafts (drafters.py).
    ``eos``: the stop token ids, [E] for every row or [C, E] per row (-1 pads; ``set_stops``), or
    None; ``criteria``: stopping criteria beyond EOS and the budget (generate()'s); ``freeze``,
    ``time_limits``: see ``commit``. ``recompute``: a rotary.Recompute when standard decoding recomputes
    its cache at some slot. ``span``: run every pass over rows 0..span-1 (generate(): processors
    then see the whole batch, as in standard decoding), else over the rows up to the last active
    one. ``history``: keep each cycle's k and drafter (``k_per_cycle``, ``drafter_per_cycle``:
    generate()'s stats; a server's long run keeps only ``k``, the last). ``scores``: a processors.ScoreHistory when the criteria are
    handed the processed scores (generate() returning scores), recorded from the prefill and the
    verify passes. ``keep_prefill``: keep the prefill's raw logits (float32 [n, V],
    ``prefill_logits``) for returned logits / scores.
    """

    def __init__(self, fwd, lora, policy, gate: Gate, drafters, *, capacity: int, pad_id: int, eos=None,
                 criteria=None, freeze: bool = True, time_limits=(), recompute=None, span: int | None = None,
                 history: bool = True, scores=None, keep_prefill: bool = False):
        self.fwd, self.lora, self.policy, self.gate, self.drafters, self.span = fwd, lora, policy, gate, drafters, span
        self.batch = Batch.empty(capacity, fwd.layout.width, pad_id, fwd.layout.positions.device)
        self.eos, self.criteria, self.freeze, self.recompute = eos, criteria, freeze, recompute
        self.time_limits = time_limits
        self.names = [None] * capacity  # each row's adapter
        self.timer = PassTimer(self.batch.tokens.device)
        self.threads = None  # threads.Contention while installed on the CPU (session.py)
        self.cycles, self.k, self.k_per_cycle, self.history = 0, 0, [], history
        self.drafter_per_cycle, self.draft_passes = [], 0
        self.drafted, self.accepted, self.row_cycles = [0] * capacity, [0] * capacity, [0] * capacity
        self.waiting = [False] * capacity  # rows whose prompt is being prefilled in chunks (prefill)
        self.scores, self.keep_prefill, self.prefill_logits = scores, keep_prefill, None

    def admit(self, idx: list[int], input_ids, attention_mask, positions, max_new: list[int], names: list[str],
              upto: int | None = None, cached: int = 0):
        """Rows ``idx`` start on ``input_ids`` [n, P] (left-padded; ``attention_mask`` and
        ``positions`` as generate() gives them), prefilled with LoRA on: the whole prompt in one pass
        (``upto`` None), whose last position gives each its first token; or its slots [0, upto) only
        (0: none yet), a chunked prefill that ``prefill`` continues (``chunkable`` models only).
        ``cached``: the cache holds slots [0, cached) of these rows already (a continued generate()
        call: SharedCache.load), and the prefill starts after them, as standard decoding's does.
        Returns the tokens kept per row (host list, all rows), or None while the prompt is not all
        prefilled."""
        p = input_ids.shape[1]
        for r, name in zip(idx, names):
            self.names[r] = name
            self.drafted[r] = self.accepted[r] = self.row_cycles[r] = 0
        self._rows_changed()
        self.fwd.cache.clear(idx, cached)  # nothing of the rows' earlier requests is read (SharedCache.clear)
        self.batch.load(idx, input_ids, max_new)
        self.fwd.layout.load(idx, attention_mask, positions, [p + m - 2 for m in max_new])
        if upto == 0:
            for r in idx:
                self.batch.done_h[r] = self.waiting[r] = True
            return None
        return self.prefill(idx, cached, p if upto is None else min(upto, p))

    @property
    def chunkable(self) -> bool:
        """A prompt may be prefilled in chunks with the same result: no cache layer keeps a window of
        keys (standard decoding's one prompt pass attends past it; a later chunk could not)."""
        return all(config.invisiblelora.window is None for _, config in self.fwd.layout.makers.values())

    def prefill(self, idx: list[int], start: int, end: int):
        """Prompt slots [start, end) of rows ``idx`` (admitted together) through one LoRA-on pass,
        attending to the slots before ``start`` as a verify pass does. Until the prompt's end the rows
        wait (done: cycles leave them out; the slots a cycle writes for a waiting row are at and past
        its last prompt slot, which its last chunk writes again; ``waiting``) and None is returned; the
        last chunk gives each row its first token, as admit() describes."""
        batch, p = self.batch, self.batch.plen_h[idx[0]]
        sub = torch.tensor(idx, device=batch.tokens.device)
        prompt = self.policy.wants_prompt(idx)  # prompt log-probabilities: every position's logits
        logits = self.fwd(batch.tokens[sub, start:end], sub.new_full((len(idx),), start), end,
                          keep=end - start if prompt else 1, prefix=p if (start, end) == (0, p) else None, rows=sub)
        if prompt:
            self.policy.keep_prompt(batch, idx, logits, start)
            logits = logits[:, -1:]
        for r in idx:
            batch.done_h[r] = self.waiting[r] = end < p
        if end < p:
            return None
        if self.keep_prefill:  # a copy: processors may edit their input in place
            self.prefill_logits = logits[:, -1].to(torch.float32, copy=True)
        scores = self.policy.scores(batch, sub, logits, offset=0, target=True)
        if self.scores is not None:
            self.scores.record(sub, [0] * len(idx), scores)
        n, next_token = self.policy.accept(batch.tokens.new_zeros(len(idx), 0), None, scores, batch, sub)
        hi = max(idx) + 1
        full_n, full_next = n.new_zeros(hi), n.new_zeros(hi)
        full_n[sub], full_next[sub] = n, next_token
        committed, _ = commit(batch, hi, full_n, full_next, 0, self.eos, self.criteria, self.freeze, members=idx,
                              time_limits=self.time_limits, scores=self.scores)
        return committed

    def cycle(self, joining=None):
        """One cycle over the active rows: gate, draft, verify, accept, commit. Returns the tokens
        kept per row (host list, rows 0..hi-1). ``joining`` (rows, start, end): a chunk of prompt
        slots of rows waiting for their prompt (admitted with ``upto=0``: a serving engine's
        prefill, ``chunkable`` models) rides in the verify pass (one pass a cycle, as vLLM's chunked
        prefill mixes prompt and decode tokens); its last chunk gives each of them its first token,
        as ``prefill`` does, and the list spans them too."""
        batch = self.batch
        if self.threads is not None:
            self.threads.follow()
        hi, active = self.span or batch.hi, batch.active
        self.gate.set_rows(self.names[:hi])
        # What each drafter can offer each row this cycle (prompt lookup: how long a match), for the gate.
        plans = [d.plan(batch, hi) for d in self.drafters] if self.gate.mode == "auto" else [None] * len(self.drafters)
        labels = [None if plan is None else plan.labels for plan in plans]
        k = self.gate.choose([0 if batch.done_h[r] else batch.max_new_h[r] - batch.gen_h[r] for r in range(hi)], labels)
        self.cycles, self.k = self.cycles + 1, k
        pick = self.gate.pick
        builds, drafter = self.fwd.builds, self.drafters[pick]
        if self.history:
            self.k_per_cycle.append(k)
            self.drafter_per_cycle.append(drafter.key if k else None)
            self.draft_passes += k if drafter.passes else 0
        with self.timer("draft"):
            drafts, draft_probs = drafter.propose(self.fwd, batch, hi, k, self.policy, plans[pick])
        if self.recompute is not None:
            self.recompute.before_verify(self.fwd, batch)
        # The gate weighs whole cycles: what follows the drafts (verify, accept, commit) is timed as
        # one, so the work a cycle does besides its passes counts against the k that caused it.
        with self.timer("verify"):
            scores, joined = verify(self.fwd, batch, hi, k, self.policy, joining)
            n, next_token = self.policy.accept(drafts, draft_probs, scores, batch, slice(0, hi))
            if self.recompute is not None:
                n, next_token = self.recompute.cap(batch, hi, n, next_token, drafts)
            if self.scores is not None:  # position t of the verify pass chose token gen + t
                self.scores.record(torch.arange(hi, device=scores.device), batch.gen_h[:hi], scores,
                                   live=[not d for d in batch.done_h[:hi]])
            span = hi
            if joining is not None:
                span, n, next_token = self._joined(joining, joined, hi, n, next_token)
            committed, n_h = commit(batch, span, n, next_token, k, self.eos, self.criteria, self.freeze,
                                    time_limits=self.time_limits, scores=self.scores)
        drafter.learn(batch, hi, n_h)
        for r in active:
            self.drafted[r] += k
            self.accepted[r] += n_h[r]
            self.row_cycles[r] += 1
        spans = self.timer.collect()
        if self.fwd.builds == builds:  # not a pass's compilation (nor, for its cost, one with prompt slots)
            self.gate.observe(k, n_h[:hi], [r in active for r in range(hi)], spans.get("draft"),
                              spans["verify"] if joining is None else None, labels[pick])
        return committed

    def _joined(self, joining, logits, hi: int, n, next_token):
        """After a verify pass that ran ``joining``'s prompt chunk: (the rows the commit spans, n,
        next token), with the joining rows' first tokens (from ``logits``, their last prompt slot's)
        if the chunk ended their prompts; they then decode from the next cycle on."""
        rows, _, end = joining
        batch, span = self.batch, max(hi, max(rows) + 1)
        waiting = end < batch.plen_h[rows[0]]  # more chunks to come
        for r in rows:
            batch.done_h[r] = self.waiting[r] = waiting
        sub = torch.tensor(rows, device=n.device)
        full_n, full_next = n.new_zeros(span), next_token.new_zeros(span)
        full_n[:hi], full_next[:hi] = n, next_token
        full_n[sub] = 0  # (rows among 0..hi-1 rode along in the drafts: nothing of theirs is kept)
        if waiting:
            return span, full_n, full_next
        scores = self.policy.scores(batch, sub, logits, offset=0, target=True)
        full_n[sub], full_next[sub] = self.policy.accept(batch.tokens.new_zeros(len(rows), 0), None, scores, batch, sub)
        return span, full_n, full_next

    # --- rows changed from outside the cycle (the serving engine) ---

    def set_stops(self, r: int, stops: list[int]) -> None:
        """Row r's stop token ids, in the per-row table (widened if they are more)."""
        table = self.eos
        if len(stops) > table.shape[1]:
            table = torch.cat([table, table.new_full((table.shape[0], len(stops) - table.shape[1]), -1)], 1)
        table[r] = -1
        table[r, : len(stops)] = torch.tensor(stops, dtype=table.dtype, device=table.device)
        self.eos = table

    def free(self, r: int) -> None:
        """Row r holds no request any more: no adapter, no policy state (its slots are reused)."""
        self.batch.done_h[r] = True
        self.waiting[r] = False
        self.names[r] = None
        self.policy.release(r)

    def reset(self, rows: list[int], room: int) -> None:
        """Free ``rows`` after a failure, whatever was half-done: a free row rides along in cycles,
        so its counts are made to keep its slots in range (``room``: the slots a row may use)."""
        batch = self.batch
        for r in rows:
            self.free(r)
            batch.stop_at[r] = None
            batch.gen_h[r], batch.plen_h[r] = 0, min(max(batch.plen_h[r], 1), room)
        batch.sync()
        self._rows_changed()

    def remaining(self, r: int) -> int:
        """Tokens row r may still commit."""
        return self.batch.max_new_h[r] - self.batch.gen_h[r]

    def generated(self, r: int) -> int:
        return self.batch.gen_h[r]

    def end_reason(self, r: int) -> str | None:
        """None while row r decodes or waits for its prompt's chunks; once done, "length" (its budget)
        or "stop" (a stop token)."""
        b = self.batch
        if not b.done_h[r] or self.waiting[r]:
            return None
        return "length" if b.gen_h[r] >= b.max_new_h[r] and b.stop_at[r] is None else "stop"

    def new_tokens(self, committed: list[int]) -> list[list[int]]:
        """Each row's newly committed tokens (its last ``committed[r]``), in one copy to the host (one
        device sync)."""
        if not any(committed):
            return [[] for _ in committed]
        b, tokens = self.batch, self.batch.tokens[: len(committed)].tolist()
        return [tokens[r][b.plen_h[r] + b.gen_h[r] - n : b.plen_h[r] + b.gen_h[r]] if n else []
                for r, n in enumerate(committed)]

    def set_lora(self, lora) -> None:
        """A new LoRA switch (the adapters changed: a new bank, whose slots may move); rows in flight go on."""
        self.lora = self.fwd.lora = lora
        self._rows_changed()

    def _rows_changed(self) -> None:
        self.lora.set_rows(self.names)
        self.fwd.set_rows(self.names)

    # --- generate()'s output ---

    def output_length(self) -> int:
        """New tokens in generate()'s output: as many as standard decoding's steps."""
        batch = self.batch
        if not self.freeze and None not in batch.stop_at:
            return min(max(batch.stop_at), max(batch.max_new_h))
        return max(batch.gen_h)

    def fill_stats(self, stats, new: int) -> None:
        """generate()'s DecodingStats: per row, and the gate's decisions per cycle."""
        stats.cycles, stats.k_per_cycle, stats.draft_passes = self.cycles, self.k_per_cycle, self.draft_passes
        stats.drafter_per_cycle = self.drafter_per_cycle
        stats.drafted, stats.accepted, stats.row_cycles = self.drafted, self.accepted, self.row_cycles
        stats.committed = [min(g, new) for g in self.batch.gen_h]
        stats.cache_bytes = self.fwd.cache.nbytes

    def sequences(self, idx: list[int], length: int, pad_id: int):
        """[n, length] tokens of rows ``idx`` (prompt and generated), padding past each row's end."""
        seqs = self.batch.tokens[idx, :length].clone()
        ends = torch.tensor([self.batch.plen_h[r] + self.batch.gen_h[r] for r in idx], device=seqs.device)
        return seqs.masked_fill_(torch.arange(length, device=seqs.device) >= ends[:, None], pad_id)


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
