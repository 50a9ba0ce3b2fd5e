"""Property-based: random batches, masks, adapter mixes, K, lengths, EOS and gate modes decode exactly
as standard PEFT decoding (float64, greedy), with consistent stats and the model left unchanged."""

import os

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.model.walk import lora_layers
from tiny import PAD, tiny_peft

EXAMPLES = int(os.environ.get("PROPERTY_EXAMPLES", 150))  # more for a longer search
VOCAB = 64
NAMES = ["s", "b", "c", "d", "__base__"]
MODELS = {}


def model_for(arch):
    if arch not in MODELS:
        MODELS[arch] = tiny_peft(arch, vocab=VOCAB, strength=0.5, seed=7)
    return MODELS[arch]


@st.composite
def batches(draw):
    b = draw(st.integers(1, 6))
    width = draw(st.integers(1, 9))
    rows, masks = [], []
    for _ in range(b):
        kind = draw(st.sampled_from(["left", "left", "right", "holes"]))
        n = draw(st.integers(1, width))
        if kind == "left":
            mask = [0] * (width - n) + [1] * n
        elif kind == "right":
            mask = [1] * n + [0] * (width - n)
        else:
            mask = draw(st.lists(st.integers(0, 1), min_size=width, max_size=width))
            mask[draw(st.integers(0, width - 1))] = 1  # at least one token
        tokens = draw(st.lists(st.integers(2, VOCAB - 1), min_size=width, max_size=width))
        rows.append([t if m else PAD for t, m in zip(tokens, mask)])
        masks.append(mask)
    names = draw(st.lists(st.sampled_from(NAMES), min_size=b, max_size=b))
    return torch.tensor(rows), torch.tensor(masks), names


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(batch=batches(), arch=st.sampled_from(["llama", "gemma3"]), k=st.integers(0, 4),
       gate=st.sampled_from(["always", "never", "auto"]), new=st.integers(1, 10),
       eos=st.one_of(st.none(), st.integers(2, VOCAB - 1)))
def test_same_as_standard_decoding(batch, arch, k, gate, new, eos):
    ids, mask, names = batch
    model = model_for(arch)
    kw = dict(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False, max_new_tokens=new,
              eos_token_id=eos, pad_token_id=PAD)
    ref = model.generate(**kw)
    before = [("forward" in vars(m), m._disable_adapters, len(m._forward_pre_hooks)) for m in lora_layers(model)]
    out = model.generate(**kw, invisible_lora=True, num_draft_tokens=k, gate=gate, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert [("forward" in vars(m), m._disable_adapters, len(m._forward_pre_hooks)) for m in lora_layers(model)] == before

    s = out.stats
    p = ids.shape[1]
    for row, committed in enumerate(s.committed):
        generated = ref[row, p:].tolist()
        stop = next((i + 1 for i, t in enumerate(generated) if eos is not None and t == eos), len(generated))
        assert committed == stop
    assert len(s.k_per_cycle) == len(s.drafter_per_cycle) == s.cycles
    assert all((k == 0) == (d is None) for k, d in zip(s.k_per_cycle, s.drafter_per_cycle))
    assert s.draft_passes == sum(k for k, d in zip(s.k_per_cycle, s.drafter_per_cycle) if d not in (None, "/lookup"))
    assert all(0 <= a <= d for a, d in zip(s.accepted, s.drafted))
    assert all(x <= k for x in s.k_per_cycle)
    if gate == "never" or k == 0:
        assert s.draft_passes == 0
