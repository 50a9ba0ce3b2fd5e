"""The run-time gate: how many tokens to draft this cycle (0 = a plain LoRA-on step).

Drafting pays only when the adapter work it saves exceeds the draft passes it costs. Per cycle
the gate picks k in 0..K maximising expected committed tokens per second:

    tokens(k) = sum over active rows of (1 - a^(k+1)) / (1 - a)      (a = the row adapter's
                                                                      per-draft acceptance; 1 for __base__)
    time(k)   = k * T_draft + T_verify(k + 1)                       (T_verify(1) = a plain step)

Acceptance is tracked per adapter (decayed success/trial counts, seeded by a prior); pass costs
are measured from the passes themselves, per batch shape (rows, distinct adapters) and tokens per
row. Both live on the
model, so later generate calls start informed. With nothing measured yet it calibrates: one
plain step, one cycle at K. While drafting does not pay it re-checks now and then with one
k = 1 cycle, with exponential backoff kept on the model, so a wrong estimate cannot stick and
exploring costs little.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

GATE_MODES = ("auto", "always", "never")
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.7, 4.0  # ~70-80% measured on real small-model adapters
DECAY = 0.98  # per observed cycle: recent acceptance counts more (adapters drift with the domain)
COST_EMA = 0.3
EXPLORE_AFTER = 16  # plain cycles before re-checking drafting; doubles each time it does not pay,
EXPLORE_MAX = 1024  # up to this (a k = 1 probe per 1024 plain cycles costs ~0.1%)
MARGIN = 1.05  # draft only if it promises 5% more tokens/s than a plain step: the estimates are noisy,
# and a wrong "draft" costs more than a wrong "don't"


def check_gate(gate: str, num_draft_tokens: int) -> None:
    if gate not in GATE_MODES:
        raise ValueError(f"gate must be one of {GATE_MODES}, got {gate!r}.")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be an int >= 0, got {num_draft_tokens!r}.")


@dataclass
class GateMemory:
    """What the gate learned on one model: acceptance per adapter and pass costs (seconds)."""

    accepted: dict = field(default_factory=dict)  # adapter -> decayed accepted drafts
    trials: dict = field(default_factory=dict)  # adapter -> decayed drafts judged
    costs: dict = field(default_factory=dict)  # ("draft", shape) / ("verify", shape, q) -> EMA seconds
    plain_streak: dict = field(default_factory=dict)  # shape -> plain cycles since drafting was last tried
    explore_after: dict = field(default_factory=dict)  # shape -> plain cycles before the next re-check

    def acceptance(self, adapter: str) -> float:
        a, t = self.accepted.get(adapter, 0.0), self.trials.get(adapter, 0.0)
        return (a + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)

    def observe_cost(self, key, seconds: float) -> None:
        old = self.costs.get(key)
        self.costs[key] = seconds if old is None else (1 - COST_EMA) * old + COST_EMA * seconds


def memory_of(model) -> GateMemory:
    return model.__dict__.setdefault("_invisiblelora_gate", GateMemory())


def expected_tokens(acceptance: torch.Tensor, k: int) -> float:
    """Expected committed tokens of a cycle with k drafts, summed over rows (geometric acceptance)."""
    a = acceptance.double().clamp(max=1 - 1e-9)
    return float(((1 - a ** (k + 1)) / (1 - a)).sum())


class Gate:
    """Chooses k for each cycle of one generate call; learns into a ``GateMemory``."""

    def __init__(self, mode: str, max_k: int, adapter_names: list[str], memory: GateMemory, base: str,
                 variant: str = "eager"):
        self.mode, self.max_k, self.memory = mode, max_k, memory
        self.names = adapter_names
        # What a pass's cost depends on: rows, distinct adapters, eager or compiled.
        self.shape = (len(adapter_names), len(set(adapter_names)), variant)
        self.is_base = torch.tensor([a == base for a in adapter_names])

    def choose(self, active: list[bool], longest_remaining: int) -> int:
        cap = max(0, min(self.max_k, longest_remaining - 1))
        if self.mode == "always" or cap == 0:
            return cap
        active_t = torch.tensor(active)
        if self.mode == "never" or bool(self.is_base[active_t].all()):
            return 0  # no adapter work to save: the LoRA-on step costs what a draft step costs
        costs = self._costs()
        if costs is None:  # calibrate: a plain step first, then one cycle at cap
            return 0 if ("verify", self.shape, 1) not in self.memory.costs else cap
        acc = torch.tensor([1.0 if b else self.memory.acceptance(a) for a, b in zip(self.names, self.is_base)])
        acc = acc[active_t]
        rate = [expected_tokens(acc, k) / costs[k] for k in range(cap + 1)]
        rate[0] *= MARGIN
        best = max(range(cap + 1), key=rate.__getitem__)
        m = self.memory
        if best:
            m.plain_streak[self.shape], m.explore_after[self.shape] = 0, EXPLORE_AFTER
            return best
        # Re-check now and then that drafting still does not pay, with the cheapest probe (k = 1):
        # it refreshes the acceptance estimates and the draft cost. The backoff lives on the model,
        # so many short calls do not each pay for a probe.
        m.plain_streak[self.shape] = m.plain_streak.get(self.shape, 0) + 1
        if m.plain_streak[self.shape] >= m.explore_after.get(self.shape, EXPLORE_AFTER):
            m.plain_streak[self.shape] = 0
            m.explore_after[self.shape] = min(EXPLORE_MAX, 2 * m.explore_after.get(self.shape, EXPLORE_AFTER))
            return 1
        return 0

    def _costs(self):
        """Estimated seconds of a cycle with k = 0..K drafts, or None before the first measurements.

        Verify cost for unmeasured token counts is interpolated linearly between measured ones.
        """
        c = self.memory.costs
        t_draft = c.get(("draft", self.shape))
        measured = sorted((key[2], v) for key, v in c.items() if key[0] == "verify" and key[1] == self.shape)
        if t_draft is None or len(measured) < 2:
            return None
        qs = torch.tensor([q for q, _ in measured], dtype=torch.double)
        ts = torch.tensor([t for _, t in measured], dtype=torch.double)
        out = []
        for k in range(self.max_k + 1):
            q = k + 1
            i = int(torch.searchsorted(qs, torch.tensor(float(q), dtype=torch.double)).clamp(1, len(qs) - 1))
            t_verify = ts[i - 1] + (ts[i] - ts[i - 1]) * (q - qs[i - 1]) / (qs[i] - qs[i - 1])
            out.append(k * t_draft + max(float(t_verify), 1e-9))
        return out

    def observe(self, k: int, n_accepted: list[int], active: list[bool], draft_s: float | None, verify_s: float):
        """Learn from one cycle: k drafts, per-row accepted counts (rows active at its start), pass times."""
        m = self.memory
        if k:
            m.observe_cost(("draft", self.shape), draft_s / k)
            for name, n, act, base in zip(self.names, n_accepted, active, self.is_base.tolist()):
                if act and not base:
                    # n successes, then one failure unless every draft was kept (Bernoulli per position).
                    m.accepted[name] = DECAY * m.accepted.get(name, 0.0) + n
                    m.trials[name] = DECAY * m.trials.get(name, 0.0) + n + (n < k)
        m.observe_cost(("verify", self.shape, k + 1), verify_s)


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
