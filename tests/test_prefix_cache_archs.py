"""Prefix caching across architectures: every causal LM docs/support.md serves ("identical"), as the
architecture sweep's tiny model with its two adapters (tools/arch_sweep.py), served by the engine
with prefix caching on: the same system prompt under an adapter twice (the second takes the first's
blocks), under the other adapter and the base model; every answer equals stock PEFT's generate() of
that prompt alone. An architecture the engine refuses is skipped with its reason."""

import pytest
import torch
from arch_sweep import sweep_case
from test_architectures import DOCUMENTED

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.engine import Engine, Request
from hf_invisiblelora.engine.prefix_cache import BLOCK

SERVED = sorted(arch for arch, (verdict, _) in DOCUMENTED.items() if verdict == "identical")
NEW = 5


@pytest.mark.parametrize("arch", SERVED)
def test_cached_prefixes_decode_as_stock(arch):
    model, note = sweep_case(arch)
    if model is None:
        pytest.skip(note)
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, min(vocab, 64), (2 * BLOCK + 3,), generator=g).tolist()
    jobs = [(system + [5, 6], "s"), (system + [7], "s"), (system + [8, 9, 10], "b"), (system + [4], "__base__")]
    try:
        engine = Engine(model, max_batch=2, max_len=64, num_draft_tokens=2)
    except ValueError as e:
        pytest.skip(f"the engine refuses it: {e}")
    engine.start()
    try:
        answers = [engine.submit(Request(p, adapter=a, max_tokens=NEW, temperature=0)).result(120)
                   for p, a in jobs]
        cached = engine._scheduler.prefix is not None
        hits = engine.metrics_snapshot()["prefix_hits"]
    finally:
        engine.stop()
    for (prompt, adapter), answer in zip(jobs, answers):
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), adapter_names=[adapter], max_new_tokens=NEW,
                                 do_sample=False)
        assert answer == out[0, len(prompt):].tolist(), (arch, adapter, note)
    assert hits == (2 * BLOCK if cached else 0)
