"""Architecture sweep: every causal LM in Transformers' auto mapping, as a tiny random model derived
from its default config (tests/arch_sweep.py), wrapped with two PEFT LoRA adapters, decodes
a mixed, left-padded batch with "__base__" exactly as stock PEFT does (greedy, K = 1 and 3), or is
refused before decoding with the model unchanged. Sliding windows (4) are shorter than the output
(12 tokens); chunked attention (8) is crossed. Then every architecture whose rotary embedding
can be made length-dependent again with dynamic NTK RoPE whose switch point the output crosses.
docs/support.md has the resulting table (benchmarks/arch_sweep_report.py writes it).
"""

import pytest

from arch_sweep import causal_lm_architectures, dynamic_rope, sweep_verdict

@pytest.mark.parametrize("arch", causal_lm_architectures())
def test_architecture(arch):
    outcome, reason = sweep_verdict(arch)
    if outcome == "skipped":
        pytest.skip(reason)


@pytest.mark.parametrize("arch", causal_lm_architectures())
def test_architecture_with_dynamic_rope(arch):
    outcome, reason = sweep_verdict(arch, dynamic_rope)
    if outcome == "skipped":
        pytest.skip(reason)
