"""Decoding statistics of one InvisibleLoRA generate call."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodingStats:
    """Per-row counts (index = row of the batch) and per-cycle gate decisions.

    ``drafted[b]``: draft tokens proposed for row b; ``accepted[b]``: those the verify pass kept;
    ``committed[b]``: new tokens in the output (accepted drafts + one target token per cycle,
    cut at EOS / stopping criteria / max length).
    """

    adapter_names: list[str]
    max_draft_tokens: int
    cycles: int = 0
    draft_passes: int = 0
    k_per_cycle: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    cache_bytes: int = 0  # the hybrid KV cache's allocation (keys + values, all layers)

    def __post_init__(self):
        n = len(self.adapter_names)
        self.drafted = self.drafted or [0] * n
        self.accepted = self.accepted or [0] * n
        self.committed = self.committed or [0] * n

    @property
    def gate_skips(self) -> int:
        """Cycles where the gate drafted nothing (a plain LoRA-on step) although drafting was allowed."""
        return sum(1 for k in self.k_per_cycle if k == 0) if self.max_draft_tokens else 0

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(self.drafted)
        return sum(self.accepted) / drafted if drafted else 0.0

    @property
    def per_adapter(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for name, d, a, c in zip(self.adapter_names, self.drafted, self.accepted, self.committed):
            s = out.setdefault(name, {"rows": 0, "drafted": 0, "accepted": 0, "committed": 0})
            s["rows"] += 1
            s["drafted"] += d
            s["accepted"] += a
            s["committed"] += c
        for s in out.values():
            s["acceptance"] = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        return out

    def to_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "draft_passes": self.draft_passes,
            "gate_skips": self.gate_skips,
            "k_per_cycle": self.k_per_cycle,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "acceptance_rate": self.acceptance_rate,
            "per_adapter": self.per_adapter,
            "cache_bytes": self.cache_bytes,
        }

    def summary(self) -> str:
        lines = [
            f"cycles {self.cycles} (draft passes {self.draft_passes}, "
            f"gate skipped drafting {self.gate_skips}x); acceptance {self.acceptance_rate:.1%}; "
            f"tokens per cycle {sum(self.committed) / max(self.cycles, 1) / max(len(self.committed), 1):.2f} per row"
        ]
        for name, s in self.per_adapter.items():
            lines.append(
                f"  {name:>16}: rows {s['rows']}, drafted {s['drafted']}, accepted {s['accepted']} "
                f"({s['acceptance']:.1%}), committed {s['committed']}"
            )
        return "\n".join(lines)
