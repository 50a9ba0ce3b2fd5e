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
rows free up. Each row's state is one record (batch.Row: its phase, counts, adapter and drafts); the
host learns the counts once per cycle (one device sync).

What differs between those uses is the ``policy``: how scores are processed, how a token is
picked from them and how drafts are accepted (greedy, speculative sampling, or per-request
seeded sampling), and its per-row state.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .. import tuning
from .batch import Batch, Phase, commit
from .gate import Gate


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
        self.timer = PassTimer(self.batch.tokens.device)
        self.threads = None  # threads.Contention while installed on the CPU (session.py)
        self.cycles, self.k, self.k_per_cycle, self.history = 0, 0, [], history
        self.drafter_per_cycle, self.draft_passes = [], 0
        self.rows = self.batch.rows  # each row's record (batch.Row)
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
            row = self.rows[r]
            row.adapter, row.drafted, row.accepted, row.cycles = name, 0, 0, 0
        self._rows_changed()
        self.fwd.cache.clear(idx, cached)  # nothing of the rows' earlier requests is read (SharedCache.clear)
        self.batch.load(idx, input_ids, max_new)
        self.fwd.layout.load(idx, attention_mask, positions, [p + m - 2 for m in max_new])
        if upto == 0:
            for r in idx:
                self.rows[r].phase = Phase.PREFILLING
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
        wait (Phase.PREFILLING: cycles leave them out; the slots a cycle writes for such a row are at
        and past its last prompt slot, which its last chunk writes again) and None is returned; the
        last chunk gives each row its first token, as admit() describes."""
        batch, p = self.batch, self.rows[idx[0]].plen
        sub = torch.tensor(idx, device=batch.tokens.device)
        prompt = self.policy.wants_prompt(idx)  # prompt log-probabilities: every position's logits
        logits = self.fwd(batch.tokens[sub, start:end], sub.new_full((len(idx),), start), end,
                          keep=end - start if prompt else 1, prefix=p if (start, end) == (0, p) else None, rows=sub)
        if prompt:
            self.policy.keep_prompt(batch, idx, logits, start)
            logits = logits[:, -1:]
        for r in idx:
            self.rows[r].phase = Phase.PREFILLING if end < p else Phase.DECODING
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
        k = self.gate.choose([row.left if row.decoding else 0 for row in self.rows[:hi]], labels)
        self.cycles, self.k = self.cycles + 1, k
        pick = self.gate.pick
        builds, lookups, drafter = self.fwd.builds, tuning.lookups(), self.drafters[pick]
        if self.history:
            self.k_per_cycle.append(k)
            self.drafter_per_cycle.append(drafter.key if k else None)
            self.draft_passes += k if drafter.passes else 0
        if k and drafter.passes:  # its copies made (or checked) outside the pass the gate times
            drafter.ready()
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
                self.scores.record(torch.arange(hi, device=scores.device), [row.gen for row in self.rows[:hi]],
                                   scores, live=[row.decoding for row in self.rows[:hi]])
            span = hi
            if joining is not None:
                span, n, next_token = self._joined(joining, joined, hi, n, next_token)
            committed, n_h = commit(batch, span, n, next_token, k, self.eos, self.criteria, self.freeze,
                                    time_limits=self.time_limits, scores=self.scores)
        drafter.learn(batch, hi, n_h)
        for r in active:
            row = self.rows[r]
            row.drafted, row.accepted, row.cycles = row.drafted + k, row.accepted + n_h[r], row.cycles + 1
        spans = self.timer.collect()
        # A cycle that compiled a pass or measured a choice (tuning.py: once per machine) took more
        # than its passes' time: its acceptance counts, its times do not (nor, for its cost, the
        # time of a verify pass with prompt slots).
        timed = self.fwd.builds == builds and tuning.lookups() == lookups
        self.gate.observe(k, n_h[:hi], [r in active for r in range(hi)], spans.get("draft") if timed else None,
                          spans["verify"] if timed and joining is None else None, labels[pick])
        return committed

    def _joined(self, joining, logits, hi: int, n, next_token):
        """After a verify pass that ran ``joining``'s prompt chunk: (the rows the commit spans, n,
        next token), with the joining rows' first tokens (from ``logits``, their last prompt slot's)
        if the chunk ended their prompts; they then decode from the next cycle on."""
        rows, _, end = joining
        batch, span = self.batch, max(hi, max(rows) + 1)
        waiting = end < self.rows[rows[0]].plen  # more chunks to come
        for r in rows:
            self.rows[r].phase = Phase.PREFILLING if waiting else Phase.DECODING
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
        self.rows[r].phase, self.rows[r].adapter = Phase.FREE, None
        self.policy.release(r)

    def reset(self, rows: list[int], room: int) -> None:
        """Free ``rows`` after a failure, whatever was half-done: a free row rides along in cycles,
        so its counts are made to keep its slots in range (``room``: the slots a row may use)."""
        for r in rows:
            self.free(r)
            row = self.rows[r]
            row.stop_at, row.gen, row.plen = None, 0, min(max(row.plen, 1), room)
        self.batch.sync()
        self._rows_changed()

    @property
    def names(self) -> list:
        """Each row's adapter (None: free)."""
        return [row.adapter for row in self.rows]

    def end_reason(self, r: int) -> str | None:
        """None while row r decodes or waits for its prompt's chunks; once done, "length" (its budget)
        or "stop" (a stop token)."""
        row = self.rows[r]
        if row.phase in (Phase.DECODING, Phase.PREFILLING):
            return None
        return "length" if row.gen >= row.max_new and row.stop_at is None else "stop"

    def new_tokens(self, committed: list[int]) -> list[list[int]]:
        """Each row's newly committed tokens (its last ``committed[r]``), in one copy to the host (one
        device sync)."""
        if not any(committed):
            return [[] for _ in committed]
        tokens = self.batch.tokens[: len(committed)].tolist()
        return [tokens[r][row.end - n : row.end] if n else [] for r, (row, n) in enumerate(zip(self.rows, committed))]

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
        stops = [row.stop_at for row in self.rows]
        if not self.freeze and None not in stops:
            return min(max(stops), max(row.max_new for row in self.rows))
        return max(row.gen for row in self.rows)

    def fill_stats(self, stats, new: int) -> None:
        """generate()'s DecodingStats: per row, and the gate's decisions per cycle."""
        stats.cycles, stats.k_per_cycle, stats.draft_passes = self.cycles, self.k_per_cycle, self.draft_passes
        stats.drafter_per_cycle = self.drafter_per_cycle
        stats.drafted, stats.accepted = [row.drafted for row in self.rows], [row.accepted for row in self.rows]
        stats.row_cycles = [row.cycles for row in self.rows]
        stats.committed = [min(row.gen, new) for row in self.rows]
        stats.cache_bytes = self.fwd.cache.nbytes

    def sequences(self, idx: list[int], length: int, pad_id: int):
        """[n, length] tokens of rows ``idx`` (prompt and generated), padding past each row's end."""
        seqs = self.batch.tokens[idx, :length].clone()
        ends = torch.tensor([self.rows[r].end for r in idx], device=seqs.device)
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
