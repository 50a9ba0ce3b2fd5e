"""Architecture sweep: every causal LM in Transformers' auto mapping, as a tiny random model derived
from its default config (tools/arch_sweep.py), wrapped with two PEFT LoRA adapters, decodes
a mixed, left-padded batch with "__base__" exactly as stock PEFT does (greedy, K = 1 and 3), or is
refused before decoding with the model unchanged. Sliding windows (4) are shorter than the output
(12 tokens); chunked attention (8) is crossed. Then every architecture whose rotary embedding
can be made length-dependent again with dynamic NTK RoPE whose switch point the output crosses.

Each verdict is pinned to docs/support.md's table (tools/arch_sweep_report.py writes it): an
architecture served there that comes out refused fails here, as does a refused one that comes
out served (the table must say so). Skips (a missing optional dependency, a Transformers bug) stay
skips. Architectures of a Transformers release newer than the table's (setup.cfg takes a range)
are not pinned: they must be identical or refused, as any.
"""

import re
from pathlib import Path

import pytest
from arch_sweep import causal_lm_architectures, dynamic_rope, sweep_verdict

SUPPORT = Path(__file__).resolve().parent.parent / "docs" / "support.md"


def documented() -> dict:
    """{architecture: (verdict, verdict with dynamic RoPE)} of docs/support.md's table."""
    rows = re.findall(r"^\| (\S+) \| [^|]+ \| (identical|refused|skipped) \|[^|]*\| (\S+) \|$",
                      SUPPORT.read_text(), re.M)
    return {arch: (verdict, dynamic) for arch, verdict, dynamic in rows}


DOCUMENTED = documented()


def check(arch, outcome, reason, column):
    if outcome == "skipped":
        pytest.skip(reason)
    if arch not in DOCUMENTED:  # newer than the table (sweep_verdict asserted the rest)
        return
    expected = DOCUMENTED[arch][column]
    assert outcome == expected, (f"{arch}: {outcome} ({reason}), docs/support.md says {expected}: a regression, or "
                                 "the table is stale (tools/arch_sweep_report.py)")


def test_the_table_lists_the_architectures_it_was_made_for():
    """The table covers this Transformers' architectures, but for those of a newer release."""
    import transformers

    missing = set(causal_lm_architectures()) - set(DOCUMENTED)
    made_for = re.search(r"transformers (\d+\.\d+\.\d+)", SUPPORT.read_text()).group(1)
    if transformers.__version__ == made_for:
        assert not missing, missing


@pytest.mark.parametrize("arch", causal_lm_architectures())
def test_architecture(arch):
    check(arch, *sweep_verdict(arch), 0)


@pytest.mark.parametrize("arch", causal_lm_architectures())
def test_architecture_with_dynamic_rope(arch):
    check(arch, *sweep_verdict(arch, dynamic_rope), 1)
