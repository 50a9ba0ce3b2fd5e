"""Speculative sampling keeps the target distribution: chi-square against exact enumeration."""

import pytest
import torch

import hf_invisiblelora  # noqa: F401  (makes generate() accept invisible_lora=True)
from tiny import chi_square_p, tiny_peft

VOCAB, N, TEMPERATURE, TOP_K = 8, 3000, 0.8, 3
SUPPRESS = [0, 1]  # pad and EOS never sampled, so every row generates exactly 3 tokens
PROMPT = torch.tensor([[5, 2, 7, 3]])


def processed_probs(logits):
    """The processing generate() applies here: suppress tokens, temperature, top-k; then softmax."""
    s = logits.clone()
    s[..., SUPPRESS] = -float("inf")
    s = s / TEMPERATURE
    kth = s.topk(TOP_K, -1).values[..., -1:]
    return s.masked_fill(s < kth, -float("inf")).softmax(-1)


def exact(model, adapter, steps=3):
    """P(first `steps` tokens) for one adapter, by enumerating every continuation."""
    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in out.items():
            ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long).reshape(1, -1)], 1)
            probs = processed_probs(model(input_ids=ids, adapter_names=[adapter]).logits[0, -1])
            for t in probs.nonzero()[:, 0].tolist():
                nxt[prefix + (t,)] = p * float(probs[t])
        out = nxt
    return out


def sampled(model, adapters, k, seed):
    torch.manual_seed(seed)
    ids = PROMPT.repeat(len(adapters), 1)
    out = model.generate(input_ids=ids, adapter_names=adapters, do_sample=True, temperature=TEMPERATURE,
                         top_k=TOP_K, suppress_tokens=SUPPRESS, max_new_tokens=3, invisible_lora=True,
                         num_draft_tokens=k, gate="always", return_dict_in_generate=True)
    return [tuple(r) for r in out.sequences[:, PROMPT.shape[1]:].tolist()], out.stats


@pytest.fixture(scope="module")
def model():
    return tiny_peft("llama", vocab=VOCAB, adapters=("b", "d"), strength=1.5, seed=1)


@pytest.mark.parametrize("k", [1, 2])
def test_first_tokens_follow_the_target_distribution(model, k):
    with torch.no_grad():
        target = {name: exact(model, name) for name in ("b", "__base__")}
    rows = ["b"] * (N // 2) + ["__base__"] * (N // 2)
    samples, stats = sampled(model, rows, k, seed=k)
    lora, base = samples[: N // 2], samples[N // 2 :]
    assert chi_square_p(lora, target["b"]) > 1e-3
    assert chi_square_p(base, target["__base__"]) > 1e-3
    # The test has power: the adapter's samples are far from the base distribution, and drafts
    # were really rejected and resampled (the residual path ran).
    assert chi_square_p(lora, target["__base__"]) < 1e-6
    per = stats.per_adapter
    assert 0.2 < per["b"]["acceptance"] < 0.95
    assert per["__base__"]["acceptance"] == 1.0


def test_seeded_sampling_is_reproducible(model):
    """With a fixed k (gate "always" or "never"); the "auto" gate's k follows measured timings."""
    rows = ["b", "d", "__base__"] * 4
    assert sampled(model, rows, 2, seed=7)[0] == sampled(model, rows, 2, seed=7)[0]
    gen = torch.Generator().manual_seed(3)
    a = model.generate(input_ids=PROMPT.repeat(3, 1), adapter_names=["b", "d", "b"], do_sample=True,
                       max_new_tokens=6, invisible_lora=True, gate="always", generator=gen)
    gen.manual_seed(3)
    b = model.generate(input_ids=PROMPT.repeat(3, 1), adapter_names=["b", "d", "b"], do_sample=True,
                       max_new_tokens=6, invisible_lora=True, gate="always", generator=gen)
    assert torch.equal(a, b)


def test_enumeration_sums_to_one(model):
    with torch.no_grad():
        dist = exact(model, "d", steps=2)
    assert abs(sum(dist.values()) - 1) < 1e-9 and len(dist) == TOP_K**2
