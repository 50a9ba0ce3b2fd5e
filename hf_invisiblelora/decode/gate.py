"""The run-time gate: how many tokens to draft this cycle (0 = a plain LoRA-on step).

Drafting pays only when the adapter work it saves exceeds the draft passes it costs. A generate
call lasts until its slowest row is done (finished rows ride along in the batch), so per cycle
the gate picks k in 0..K minimising the expected time for the row expected to finish last:

    finish(k) = max over active rows of cycles(a, r, k) * time(k)
    cycles(a, r, k) = r / mu + z(n) * sqrt(r * var / mu^3)           (a = the row's per-draft acceptance,
                                                                      1 for __base__; r = tokens it has left)
    mu, var   = mean and variance of the tokens a cycle commits: m with P(m = j) = a^(j-1) (1 - a)
                for j < M, a^(M-1) for j = M = min(k + 1, r)
    time(k)   = k * T_draft + T_verify(k + 1)                       (T_verify(1) = a plain step)

and drafts only if that promises MARGIN more speed than plain steps. Drafting makes each row's
progress random, and a call lasts until the last of its n rows is done: the expected maximum of
n rows' cycle counts is their mean plus z(n) standard deviations (z: the expected maximum of n
standard normals; 0 for one row, 1.4 for 8). The term is measured, not tuned: at 8 rows accepting
86% of drafts, k = 1 gains 5% on the mean and loses it to the spread, and the first version,
without it, drafted there at 0.96x of plain steps (docs/benchmarks.md). A serving engine's rows
are requests that end on their own (``together=False``): there the gate picks the k whose cycle
commits the batch's tokens at the least time per token, time(k) / sum over rows of mu. Given
several drafters (drafters.py: by default the base model, its low-precision copies measured faster
on the CPU and prompt lookup), it picks the one whose best k finishes soonest.

Acceptance is tracked per adapter and drafter (decayed success/trial counts, seeded by a prior,
pooled over rows and calls; a cheaper drafter, drafters.py, is accepted less often); costs are measured from the cycles themselves (a draft
pass; what follows it: verify, accept, commit), per batch shape (rows, distinct adapters, eager or
compiled) and tokens per row, as the fastest of the last few timings (interference only slows a
pass, so both sides of a decision are weighed by what the work itself costs).
Both live in the model's state (state.py), so later generate calls start informed.

Exploring is cheap and gradual: with nothing measured it calibrates with the cheapest cycles (a
plain step, then k = 1); a verify width not yet timed is extrapolated from the widths that were,
and k may grow only one step past the widest verify timed, so an optimistic guess costs one cycle.
What one measurement says is reused where it holds: a draft pass (LoRA off) costs the same
whatever adapters the rows use, so its cost is kept per rows and drafter; a new adapter count
takes the shape of its verify costs from another adapter count at the same rows, scaled to its
own plain step, so it drafts or not from its first cycle without a calibration cycle of its own.
Now and then it re-checks the other side of its decision (k = 1 while not drafting, a plain
step while drafting), with exponential backoff kept on the model, so no stale estimate sticks.
A re-check that cannot change the decision is rarer: when the costs alone rule drafting out
(it would lose even if every draft were accepted), acceptance does not matter, and only the
draft cost is refreshed, every COST_BOUND_PROBE cycles at the most often.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.7, 4.0  # ~70-80% measured on real small-model adapters
DECAY = 0.98  # per observed cycle: recent acceptance counts more (adapters drift with the domain)
COST_WINDOW = 8  # a pass's cost: the fastest of its last 8 timings
PROBE_AFTER = 16  # cycles before re-checking the other side of the decision; doubles while the
PROBE_MAX = 1024  # decision holds, up to this (one off-decision cycle per 1024 costs ~0.1%)
COST_BOUND_PROBE = 256  # the first re-check when only costs decide (a k = 1 cycle that loses ~a step)
MARGIN = 1.02  # draft only if it promises 2% more speed than plain steps (estimates are noisy, and a
# wrong "draft" costs more than a wrong "don't"; docs/design.md has how this was set)


@dataclass
class Probe:
    """When to re-check the other side of a batch shape's decision."""

    drafting: bool  # the side of the last decision (k > 0)
    since: int = 0  # cycles since the other side was tried
    after: int = PROBE_AFTER  # cycles before the next re-check


@dataclass
class GateMemory:
    """What the gate learned on one model: acceptance per adapter and pass costs (seconds)."""

    accepted: dict = field(default_factory=dict)  # adapter, or (adapter, drafter key) -> decayed accepted drafts
    trials: dict = field(default_factory=dict)  # the same keys -> decayed drafts judged
    pooled: dict = field(default_factory=dict)  # drafter key -> [accepted, judged] over all its adapters
    costs: dict = field(default_factory=dict)  # ("draft", (rows, passes + drafter)) / ("verify", shape, q) -> seconds
    timings: dict = field(default_factory=dict)  # the same keys -> the last COST_WINDOW timings
    probes: dict = field(default_factory=dict)  # (shape, drafters) -> Probe

    def acceptance(self, key) -> float:
        """The per-draft acceptance of ``key`` (an adapter, or (adapter, drafter key)): its own evidence
        on a prior that is its drafter's acceptance over every adapter it drafted for (itself on
        PRIOR_ACCEPTANCE): a new adapter starts where its drafter's others stand, not at a fixed
        guess (prompt lookup is accepted far less often than the base model)."""
        drafter = key[1] if isinstance(key, tuple) else ""
        pa, pt = self.pooled.get(drafter, (0.0, 0.0))
        prior = (pa + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (pt + PRIOR_WEIGHT)
        a, t = self.accepted.get(key, 0.0), self.trials.get(key, 0.0)
        return (a + prior * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)

    def observe_acceptance(self, key, accepted: int, judged: int) -> None:
        """One row's cycle: ``accepted`` of ``judged`` drafts (decayed counts, DECAY per observation)."""
        self.accepted[key] = DECAY * self.accepted.get(key, 0.0) + accepted
        self.trials[key] = DECAY * self.trials.get(key, 0.0) + judged
        pooled = self.pooled.setdefault(key[1] if isinstance(key, tuple) else "", [0.0, 0.0])
        pooled[0], pooled[1] = DECAY * pooled[0] + accepted, DECAY * pooled[1] + judged

    def observe_cost(self, key, seconds: float) -> None:
        window = self.timings.setdefault(key, deque(maxlen=COST_WINDOW))
        window.append(seconds)
        # The fastest, not the median: other processes, the allocator and cold caches only add time,
        # and with few timings of a side (one cold plain step at calibration) a median kept the noise
        # and drafted at a loss (docs/design.md). A lasting slowdown is followed once the window turns.
        self.costs[key] = min(window)


def _best(rows, costs, options, z: float, together: bool = True) -> tuple[int, float]:
    """(k, its estimate): the k of ``options`` that finishes the row finishing last soonest (rows that
    end ``together``), else that commits the batch's tokens at the least time per token (a serving
    engine's rows: requests that end on their own); a plain step wins unless drafting promises
    MARGIN more speed. ``rows``: (acceptance, tokens left) of the active rows; ``z``: the spread's
    weight (``expected_max``)."""
    if together:
        finish = [max(cycles(a, r, k, z) for a, r in rows) * costs[k] for k in options]
    else:
        finish = [costs[k] / sum(expected_tokens(a, r, k) for a, r in rows) for k in options]
    finish[0] /= MARGIN
    k = min(options, key=finish.__getitem__)
    return k, finish[k]


def expected_tokens(a: float, remaining: int, k: int) -> float:
    """Expected tokens a row commits in a cycle of k drafts (geometric acceptance a per draft; at
    most the tokens it has left)."""
    m = min(k + 1, remaining)
    return float(m) if a >= 1 else (1 - a**m) / (1 - a)


def cycles(a: float, remaining: int, k: int, z: float) -> float:
    """Cycles of k drafts a row needs for its ``remaining`` tokens: the mean (renewal theory: r / mu;
    the last cycle's overshoot, under one cycle, is left out) plus ``z`` standard deviations
    (sqrt(r var / mu^3)), mu and var those of the tokens one cycle commits (the module docstring)."""
    m = min(k + 1, remaining)
    mu = expected_tokens(a, remaining, k)
    if a >= 1 or m == 1 or z == 0:
        return remaining / mu
    # E[m^2] = sum_j j^2 P(j): P(j) = a^(j-1) (1 - a) for j < m, a^(m-1) for j = m.
    second = sum(j * j * a ** (j - 1) * (1 - a) for j in range(1, m)) + m * m * a ** (m - 1)
    var = max(second - mu * mu, 0.0)
    return remaining / mu + z * math.sqrt(remaining * var / mu**3)


def expected_max(n: int) -> float:
    """The expected maximum of n independent standard normals (Blom's approximation: within 0.03
    for n <= 64); 0 for one."""
    return 0.0 if n <= 1 else statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


class Gate:
    """Chooses k for each cycle of one generate call; learns into a ``GateMemory``."""

    def __init__(self, mode: str, max_k: int, memory: GateMemory, base: str, passes: str = "eager",
                 drafters: tuple = ("",), together: bool = True):
        self.mode, self.max_k, self.memory, self.base = mode, max_k, memory, base
        # Rows that end together (one generate call: it lasts until its last row is done), whose
        # spread counts; a serving engine's rows are requests that end on their own.
        self.together = together
        # The drafters' keys (drafters.Drafter.key; "" the base model as it is); the gate picks one per
        # cycle (``pick``: its index), by each one's draft cost and acceptance.
        self.drafters, self.pick, self.turn = list(drafters), 0, -1
        # Verify passes run LoRA on whoever drafted: their costs depend on eager / compiled, not the
        # drafter (keyed by it, a drafter's verify costs went stale while another's were refreshed).
        self.passes = passes
        self.set_rows([])

    def set_rows(self, adapter_names: list) -> None:
        """The adapter of each row of the next cycles (None: a free row)."""
        self.names = adapter_names
        # Acceptance is learned per adapter and drafter (and per class of a drafter's proposals: ``key``).
        self.keys = [[(a, d) if d else a for a in adapter_names] for d in self.drafters]
        # What a pass's cost depends on: rows, distinct adapters, eager or compiled, torch's threads (fewer
        # while other work holds CPUs: threads.Contention; costs timed with more do not hold then).
        threads = torch.get_num_threads()
        self.shape = (len(adapter_names), len(set(a for a in adapter_names if a is not None)), self.passes, threads)
        # A draft pass runs LoRA off: its cost depends on the rows and the drafter, not the adapters.
        self.draft_shapes = [(len(adapter_names), self.passes + d, threads) for d in self.drafters]
        self.is_base = [a == self.base for a in adapter_names]

    def _key(self, j: int, i: int, labels):
        """Row i's acceptance key under drafter j, whose proposal for it is of class ``labels[i]``
        (``labels`` None: the drafter's proposals are all of one class)."""
        return self.keys[j][i] if labels is None else (self.names[i], f"{self.drafters[j]}/{labels[i]}")

    def _acceptance(self, j: int, i: int, labels) -> float:
        """Row i's per-draft acceptance under drafter j: 0 where it has nothing to propose; 1 for a
        ``__base__`` row under the base model as it is (its drafts are the target's own tokens)."""
        if labels is not None and labels[i] is None:
            return 0.0
        if self.is_base[i] and not self.drafters[j]:
            return 1.0
        return self.memory.acceptance(self._key(j, i, labels))

    def choose(self, remaining: list[int], labels: list | None = None) -> int:
        """k for the next cycle (and ``pick``, the drafter); ``remaining[b]``: tokens row b may still
        generate (0: finished); ``labels``: per drafter, None or the class of each row's proposal
        this cycle (drafters.Plan: None where it has nothing to propose)."""
        cap = max(0, min(self.max_k, max(remaining) - 1))
        self.pick = 0
        if self.mode == "always":  # several drafters take turns (each one's acceptance and cost get measured)
            self.turn += 1
            self.pick = self.turn % len(self.drafters)
        if self.mode == "always" or cap == 0:
            return cap
        # Rows without an adapter have no adapter work to save: the base model as it is drafts for them
        # at the cost of their plain step (cheaper drafters still may: speculative decoding of the base).
        all_base = all(b for b, r in zip(self.is_base, remaining) if r)
        candidates = [j for j, d in enumerate(self.drafters) if d or not all_base]
        if self.mode == "never" or not candidates:
            return 0
        labels = labels or [None] * len(self.drafters)
        costs = self._costs()
        if ("verify", self.shape, 1) not in self.memory.costs and any(costs[j] is None for j in candidates):
            return 0  # calibrate with the cheapest cycles: a plain step, then one draft per drafter
        uncalibrated = [j for j in candidates if costs[j] is None]
        if uncalibrated:
            self.pick = uncalibrated[0]
            return 1
        # Plain floats: this runs every cycle, and small tensor ops would cost more than the arithmetic.
        options = range(min(cap, len(costs[candidates[0]]) - 1) + 1)
        best, finish, perfect = 0, float("inf"), 0
        for j in candidates:
            rows = [(self._acceptance(j, i, labels[j]), r) for i, r in enumerate(remaining) if r]
            z = expected_max(sum(1 for a, _ in rows if 0 < a < 1)) if self.together else 0.0  # rows drafting at random
            k, t = _best(rows, costs[j], options, z, self.together)
            if t < finish:
                best, finish, self.pick = k, t, j
            # Would drafting pay if every draft were accepted? If not for any drafter, only costs decide.
            perfect = max(perfect, _best([(1.0, r) for _, r in rows], costs[j], options, 0.0, self.together)[0])
        k = self._probe(best, cost_bound=perfect == 0)
        if k and not best:  # a re-check of drafting: with the drafter that comes closest to paying
            self.pick = min(candidates, key=lambda j: costs[j][1])
        return k

    def _probe(self, best: int, cost_bound: bool) -> int:
        """``best``, or now and then the cheapest cycle of the other side (k = 1 if best is a plain
        step, else a plain step): it refreshes the estimates the decision rests on. The backoff
        lives on the model, so many short calls do not each pay for a probe."""
        key = (self.shape, tuple(self.drafters))
        p = self.memory.probes.get(key)
        if p is None or p.drafting != (best > 0):  # new, or the decision changed: re-check soon
            p = self.memory.probes[key] = Probe(drafting=best > 0)
        p.since += 1
        after = max(p.after, COST_BOUND_PROBE) if cost_bound else p.after
        if p.since < after:
            return best
        p.since, p.after = 0, min(PROBE_MAX, 2 * after)
        return 0 if best else 1

    def _verify_costs(self) -> list:
        """[(q, seconds)] of this shape's timed verify widths; with only a plain step timed, the
        widest-timed curve of another adapter count at the same rows, scaled to this plain step."""
        c = self.memory.costs
        timed = sorted((key[2], v) for key, v in c.items() if key[0] == "verify" and key[1] == self.shape)
        if len(timed) != 1 or timed[0][0] != 1:
            return timed
        curves = {}
        for key, v in c.items():
            # the same rows, passes and threads; another adapter count
            if key[0] == "verify" and (key[1][0], *key[1][2:]) == (self.shape[0], *self.shape[2:]) \
                    and key[1] != self.shape:
                curves.setdefault(key[1], []).append((key[2], v))
        curves = [sorted(v) for v in curves.values() if len(v) > 1 and min(v)[0] == 1]
        if not curves:
            return timed
        other = max(curves, key=lambda v: (len(v), v[-1][0]))
        scale = timed[0][1] / other[0][1]
        return timed + [(q, t * scale) for q, t in other[1:]]

    def _costs(self) -> list:
        """Per drafter, the estimated seconds of a cycle with k = 0, 1, .. of its drafts, or None
        before its draft pass (or two verify widths) was timed.

        Verify widths not timed are interpolated linearly between timed ones, or extrapolated from
        the two widest; k reaches one step past the widest timed verify (width k + 1), no further.
        """
        timed = self._verify_costs()  # one verify curve: it is the same whoever drafted
        if len(timed) < 2:
            return [None] * len(self.drafters)
        qs, ts = zip(*timed)
        verify = []
        for q in range(1, min(self.max_k, qs[-1]) + 2):
            i = min(max(bisect.bisect_left(qs, q), 1), len(qs) - 1)  # the timed pair around (or below) q
            t = ts[i - 1] + (ts[i] - ts[i - 1]) * (q - qs[i - 1]) / (qs[i] - qs[i - 1])
            if q > qs[-1]:  # past the widest timed: never cheaper than it (noisy timings can slope down)
                t = max(t, ts[-1])
            verify.append(max(t, 1e-9))
        drafts = [self.memory.costs.get(("draft", shape)) for shape in self.draft_shapes]
        return [None if d is None else [k * d + t for k, t in enumerate(verify)] for d in drafts]

    def observe(self, k: int, n_accepted: list[int], active: list[bool], draft_s: float | None,
                verify_s: float | None, labels: list | None = None):
        """Learn from one cycle: k drafts, per-row accepted counts (rows active at its start), pass times
        (None: not the passes' cost: a cycle that compiled or measured something, a verify pass that
        also ran prompt slots); ``labels``: the picked drafter's classes of the rows' proposals (``choose``)."""
        m, j = self.memory, self.pick
        if k:
            if draft_s is not None:
                m.observe_cost(("draft", self.draft_shapes[j]), draft_s / k)
            for i, (n, act) in enumerate(zip(n_accepted, active)):
                # Rows it had nothing for, and __base__ rows under the base model itself, teach nothing.
                if act and (labels is None or labels[i] is not None) and not (self.is_base[i] and not self.drafters[j]):
                    # n successes, then one failure unless every draft was kept (Bernoulli per position).
                    m.observe_acceptance(self._key(j, i, labels), n, n + (n < k))
        if verify_s is not None:
            m.observe_cost(("verify", self.shape, k + 1), verify_s)
