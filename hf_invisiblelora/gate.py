"""The run-time gate: how many tokens to draft this cycle (0 = a plain LoRA-on step)."""

from __future__ import annotations

GATE_MODES = ("auto", "always", "never")


def check_gate(gate: str, num_draft_tokens: int) -> None:
    if gate not in GATE_MODES:
        raise ValueError(f"gate must be one of {GATE_MODES}, got {gate!r}.")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be an int >= 0, got {num_draft_tokens!r}.")


def choose_k(gate: str, max_k: int, uses_lora: bool, longest_remaining: int) -> int:
    """Drafts for this cycle.

    "always": draft ``max_k`` (fixed k, for experiments); "never": plain decoding (the optimized
    multi-LoRA baseline); "auto": no drafting when no row has an adapter (the LoRA-on step then
    costs what a draft step costs), else ``max_k``. Never more drafts than the longest row can use.
    """
    k = 0 if gate == "never" or (gate == "auto" and not uses_lora) else max_k
    return max(0, min(k, longest_remaining - 1))
