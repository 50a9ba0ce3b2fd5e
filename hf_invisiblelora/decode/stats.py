"""Decoding statistics of one InvisibleLoRA generate call."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodingStats:
    """Per-row counts (index = row of the batch) and per-cycle gate decisions.

    ``drafted[b]``: draft tokens proposed for row b; ``accepted[b]``: those the verify pass kept;
    ``committed[b]``: new tokens in the output (accepted drafts + one target token per cycle,
    cut at EOS / stopping criteria / max length). ``drafter_per_cycle``: the key of the drafter
    that drafted each cycle (drafters.Drafter.key: "" the base model as it is; None for a plain
    step); ``draft_passes``: the model passes they ran (prompt lookup runs none).
    """

    adapter_names: list[str]
    max_draft_tokens: int
    cycles: int = 0
    draft_passes: int = 0
    k_per_cycle: list[int] = field(default_factory=list)
    drafter_per_cycle: list = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    row_cycles: list[int] = field(default_factory=list)  # cycles each row took part in before it finished
    cache_bytes: int = 0  # the hybrid KV cache's allocation (keys + values, all layers)

    def __post_init__(self):
        n = len(self.adapter_names)
        self.drafted = self.drafted or [0] * n
        self.accepted = self.accepted or [0] * n
        self.committed = self.committed or [0] * n
        self.row_cycles = self.row_cycles or [0] * n

    @property
    def gate_skips(self) -> int:
        """Cycles where the gate drafted nothing (a plain LoRA-on step) although drafting was allowed."""
        return sum(1 for k in self.k_per_cycle if k == 0) if self.max_draft_tokens else 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted (not "every draft rejected")."""
        drafted = sum(self.drafted)
        return sum(self.accepted) / drafted if drafted else None

    @property
    def tokens_per_cycle(self) -> float:
        """Tokens a row commits per cycle (after the prefill's first token), over all rows."""
        cycles = sum(self.row_cycles)
        return sum(c - 1 for c in self.committed if c) / cycles if cycles else 0.0

    @property
    def per_adapter(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for name, d, a, c, n in zip(self.adapter_names, self.drafted, self.accepted, self.committed, self.row_cycles):
            s = out.setdefault(name, {"rows": 0, "drafted": 0, "accepted": 0, "committed": 0, "cycles": 0})
            s["rows"] += 1
            s["drafted"] += d
            s["accepted"] += a
            s["committed"] += c
            s["cycles"] += n
        for s in out.values():
            s["acceptance"] = s["accepted"] / s["drafted"] if s["drafted"] else None
            s["tokens_per_cycle"] = (s["committed"] - s["rows"]) / s["cycles"] if s["cycles"] else 0.0
        return out

    def to_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "draft_passes": self.draft_passes,
            "gate_skips": self.gate_skips,
            "k_per_cycle": self.k_per_cycle,
            "drafter_per_cycle": self.drafter_per_cycle,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "row_cycles": self.row_cycles,
            "tokens_per_cycle": self.tokens_per_cycle,
            "acceptance_rate": self.acceptance_rate,
            "per_adapter": self.per_adapter,
            "cache_bytes": self.cache_bytes,
        }

    def summary(self) -> str:
        lines = [
            f"cycles {self.cycles} (draft passes {self.draft_passes}, "
            f"gate skipped drafting {self.gate_skips}x); acceptance {rate(self.acceptance_rate)}; "
            f"{self.tokens_per_cycle:.2f} tokens per row and cycle"
        ]
        drafting = [d for d in self.drafter_per_cycle if d is not None]
        if drafting:
            lines.append("  drafted by: " + ", ".join(f"{d or 'the base model'} in {drafting.count(d)} cycles"
                                                      for d in dict.fromkeys(drafting)))
        for name, s in self.per_adapter.items():
            lines.append(
                f"  {name:>16}: rows {s['rows']}, drafted {s['drafted']}, accepted {s['accepted']} "
                f"({rate(s['acceptance'])}), committed {s['committed']} ({s['tokens_per_cycle']:.2f} per row and cycle)"
            )
        return "\n".join(lines)


def rate(acceptance: float | None) -> str:
    """An acceptance rate for people: a percentage, or "n/a (nothing drafted)"."""
    return "n/a (nothing drafted)" if acceptance is None else f"{acceptance:.1%}"
