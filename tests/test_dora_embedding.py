"""DoRA adapters and embedding LoRA in mixed batches: token-identical to stock decoding (float64).

PEFT's own mixed batch refuses DoRA, so a DoRA call's reference is each row alone under stock
generate() with its adapter active (``set_adapter``; ``disable_adapter()`` for ``__base__`` rows).
Embedding LoRA's is PEFT's own mixed batch (``generate(adapter_names=...)``). What stays refused
(other variants, DoRA on other layers) is in test_errors.py.
"""

import contextlib

import pytest
import torch

from hf_invisiblelora.decode.drafters import BaseModelDrafter
from hf_invisiblelora.engine import Engine, Request
from hf_invisiblelora.lora.bank import get_bank
from hf_invisiblelora.model.context import PassContext
from hf_invisiblelora.model.state import state_of
from hf_invisiblelora.lora import layer as lora_layer
from hf_invisiblelora.model.walk import BASE
from tiny import ARCHS, PAD, prompts, tiny_peft, with_adapters

DORA = {
    "d1": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "d2": dict(r=2, lora_alpha=3, use_dora=True, use_rslora=True, target_modules="all-linear"),
    "p": dict(r=8, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj"]),
}
EMBEDDING = {
    "e1": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"]),
    "e2": dict(r=2, lora_alpha=3, target_modules=["embed_tokens", "q_proj", "v_proj"]),
    "p": DORA["p"],
}
BOTH = {"d1": DORA["d1"], "e2": EMBEDDING["e2"], "p": DORA["p"]}


def perturbed(model, seed=0, spread=0.3):
    """``model`` with its DoRA magnitudes moved off ||W + scaling * B @ A||, so DoRA is not LoRA, and
    random biases (Qwen2's q/k/v start at zero), which DoRA's scale leaves out."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + spread * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("base_layer.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def build(adapters, arch="llama", seed=0, strength=0.6):
    return perturbed(tiny_peft(arch, adapters=adapters, strength=strength, seed=seed), seed)


def mixed_names(adapters, rows, seed):
    g = torch.Generator().manual_seed(seed)
    pool = list(adapters) + [BASE]
    names = [pool[i % len(pool)] for i in range(rows)]  # every adapter and a base row
    return [names[i] for i in torch.randperm(rows, generator=g).tolist()]


def random_prompts(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return prompts(torch.randint(1, 10, (rows,), generator=g).tolist(), seed=seed)  # left-padded


def invisible(model, ids, mask, names, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False,
                          invisible_lora=True, **kw)


def alone(model, names, run) -> list:
    """``run(row)`` for every row with its adapter active (``set_adapter``; ``disable_adapter()`` for base rows)."""
    out = []
    with torch.no_grad():
        for row, name in enumerate(names):
            if name != BASE:
                model.set_adapter(name)
            with model.disable_adapter() if name == BASE else contextlib.nullcontext():
                out.append(run(row))
    return out


def each_row_alone(model, ids, mask, names, **kw):
    """Stock generate() of every row alone with its adapter active."""
    return alone(model, names, lambda row: model.generate(input_ids=ids[row:row + 1], attention_mask=mask[row:row + 1],
                                                          do_sample=False, **kw)[0])


def assert_rows_equal(batch, rows):
    """Each row of ``batch`` is its reference row, then padding (a reference row alone stops at its EOS)."""
    for row, ref in enumerate(rows):
        got = batch[row].tolist()
        assert got[:len(ref)] == ref.tolist() and set(got[len(ref):]) <= {PAD}, f"row {row}"


# --- the bank's layers against PEFT's, one pass -----------------------------------------------------


@pytest.fixture(params=lora_layer.PATHS)
def path(request, monkeypatch):
    """Each torch path: packed (decode steps), gathered and runs (prefills)."""
    monkeypatch.setattr(lora_layer, "FORCE_PATH", request.param)


def bank_logits(model, ids, names, mixed=True, draft=False):
    bank = get_bank(model)
    context = PassContext(lambda: True)
    with torch.no_grad(), bank.installed(context, round_delta=mixed):
        bank.begin_pass()
        with context.running(torch.zeros(len(ids), dtype=torch.long), 1, 1, adapters=bank.slots(names),
                             drafter=BaseModelDrafter(model, state_of(model)) if draft else None):
            return model(ids).logits


def alone_logits(model, ids, names):
    return torch.stack(alone(model, names, lambda row: model(ids[row:row + 1]).logits[0]))


def test_dora_differs_from_lora():
    model = build(DORA)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, q.in_features, dtype=torch.float64)
    model.set_adapter("d1")
    with torch.no_grad():
        lora = q.base_layer(x) + q.lora_B["d1"](q.lora_A["d1"](x)) * q.scaling["d1"]
        assert (q(x) - lora).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v, which DoRA scales apart
@pytest.mark.parametrize("adapters", [DORA, BOTH], ids=["dora", "dora+embedding"])
def test_dora_logits_match_each_row_alone(arch, adapters, path):
    model = build(adapters, arch)
    names = ["d1", BASE, "p", "d1", *[a for a in adapters if a not in ("d1", "p")]]
    ids = torch.randint(2, 64, (len(names), 3))
    ref = alone_logits(model, ids, names)
    for mixed in (True, False):
        assert (bank_logits(model, ids, names, mixed) - ref).abs().max() < 1e-9
    with torch.no_grad(), model.disable_adapter():
        base = model(ids).logits
    assert torch.equal(bank_logits(model, ids, names, draft=True), base)  # a draft pass is the base model


def test_bfloat16_model_with_float32_adapters(path):
    """PEFT's default for a bf16 model (float32 adapters): the same outputs bit for bit, here of a layer
    over many tokens (its rounding shows there). Scalings are powers of two, so folding the scaling
    into B rounds nothing."""
    torch.manual_seed(0)
    adapters = {"d": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"]),
                "p": dict(r=8, lora_alpha=8, target_modules=["q_proj", "o_proj"]),
                "e": dict(r=4, lora_alpha=2, target_modules=["embed_tokens", "q_proj"])}
    model = perturbed(with_adapters(ARCHS["qwen2"](64).to(torch.bfloat16).eval(), adapters))
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_magnitude_vector["d"].weight.dtype == torch.float32
    names = ["d", "p", BASE, "e", "d", "p"]
    x = torch.randn(len(names), 300, q.in_features).to(torch.bfloat16)
    one = torch.stack(alone(model, names, lambda row: q(x[row:row + 1])[0]))
    with torch.no_grad():  # DoRA rows: PEFT's one-adapter numerics (its mixed batch refuses them)
        mixed_ref = torch.stack([q(x[row:row + 1], adapter_names=[name])[0] if name != "d" else one[row]
                                 for row, name in enumerate(names)])
    bank = get_bank(model)
    for mixed, ref in ((False, one), (True, mixed_ref)):
        context = PassContext(lambda: True)
        with torch.no_grad(), bank.installed(context, round_delta=mixed):
            bank.begin_pass()
            with context.running(torch.zeros(len(names), dtype=torch.long), 1, 1, adapters=bank.slots(names)):
                assert_same_rounding(q(x), ref)
    ids = torch.randint(2, 64, (len(names), 4))
    assert_same_rounding(bank_logits(model, ids, names, mixed=False), alone_logits(model, ids, names))


def assert_same_rounding(got, ref):
    """``got`` is ``ref`` bit for bit, but where the float32 matmuls of the LoRA term summed in
    another order (on AVX-512 CPUs MKL's kernels for 300 and 1,800 rows do): then a bfloat16 output
    may differ by one unit in the last place, in at most 0.1% of the elements. The other rounding
    (the delta added in float32 instead of rounded first, or the reverse) differs in ~15% of them."""
    differ = got != ref
    assert differ.sum() <= differ.numel() // 1000, f"{int(differ.sum())} of {differ.numel()} differ"
    if differ.any():
        ulp = torch.finfo(got.dtype).eps * ref[differ].float().abs()
        assert ((got[differ].float() - ref[differ].float()).abs() <= ulp).all()


# --- generate() ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_dora_mixed_batch_matches_each_row_alone(arch, seed, k):
    model = build(DORA, arch, seed)
    names = mixed_names(DORA, 6, seed)
    ids, mask = random_prompts(len(names), seed)
    out = invisible(model, ids, mask, names, max_new_tokens=12, num_draft_tokens=k, gate="always",
                    return_dict_in_generate=True)
    assert_rows_equal(out.sequences, each_row_alone(model, ids, mask, names, max_new_tokens=12))
    assert sum(out.stats.drafted) > 0


def test_dora_active_adapter_matches_stock():
    """No adapter_names: every row on the active DoRA adapter, as stock decodes a batch."""
    model = build(DORA)
    ids, mask = random_prompts(4, 0)
    model.set_adapter("d2")
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10, invisible_lora=True,
                         num_draft_tokens=2)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])  # gemma3: a scaled embedding
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [1, 4])
def test_embedding_mixed_batch_matches_peft(arch, seed, k):
    model = tiny_peft(arch, adapters=EMBEDDING, strength=0.6, seed=seed)
    names = mixed_names(EMBEDDING, 6, seed)
    ids, mask = random_prompts(len(names), seed)
    ref = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False, max_new_tokens=12)
    out = invisible(model, ids, mask, names, max_new_tokens=12, num_draft_tokens=k, gate="always")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("seed", [0, 1])
def test_dora_embedding_and_lora_rows_together(seed):
    model = build(BOTH, "qwen2", seed)
    names = mixed_names(BOTH, 6, seed)
    ids, mask = random_prompts(len(names), seed)
    out = invisible(model, ids, mask, names, max_new_tokens=12, num_draft_tokens=3)
    assert_rows_equal(out, each_row_alone(model, ids, mask, names, max_new_tokens=12))


@pytest.mark.parametrize("adapters", [DORA, EMBEDDING], ids=["dora", "embedding"])
def test_peft_backend(adapters):
    """lora_backend="peft": PEFT's own layers in the passes (its mixed batch, DoRA rows included)."""
    model = build(adapters)
    names = mixed_names(adapters, 5, 0)
    ids, mask = random_prompts(len(names), 0)
    out = invisible(model, ids, mask, names, max_new_tokens=10, lora_backend="peft")
    assert_rows_equal(out, each_row_alone(model, ids, mask, names, max_new_tokens=10))


def test_weight_and_magnitude_changes_between_calls_are_followed():
    model = build(BOTH, "qwen2")
    names = ["d1", "e2", BASE, "p", "d1"]
    ids, mask = random_prompts(len(names), 3)
    kw = dict(max_new_tokens=10)
    before = each_row_alone(model, ids, mask, names, **kw)
    assert_rows_equal(invisible(model, ids, mask, names, num_draft_tokens=2, **kw), before)
    layers = model.base_model.model.model.layers
    with torch.no_grad():
        for layer in layers:  # an edit through .data (no version counter sees it), and an in-place one
            layer.self_attn.q_proj.lora_magnitude_vector["d1"].weight.data.mul_(1.5)
            layer.mlp.down_proj.lora_B["d1"].weight.mul_(-2)
        model.base_model.model.model.embed_tokens.lora_embedding_B["e2"].mul_(3)
    layers[1].self_attn.v_proj.set_scale("d1", 0.5)
    after = each_row_alone(model, ids, mask, names, **kw)
    assert [r.tolist() for r in after] != [r.tolist() for r in before]  # the changes change the output
    assert_rows_equal(invisible(model, ids, mask, names, num_draft_tokens=2, **kw), after)


def test_serving_engine():
    """The serving engine decodes DoRA, embedding-LoRA and plain requests as each alone."""
    model = build(BOTH, "qwen2")
    g = torch.Generator().manual_seed(0)
    names = mixed_names(BOTH, 7, 0)
    requests = [Request(torch.randint(2, 64, (1 + row % 5,), generator=g).tolist(), adapter=name, max_tokens=8,
                        temperature=0) for row, name in enumerate(names)]
    engine = Engine(model, max_batch=3, max_len=64, num_draft_tokens=2, gate="always").start()
    try:
        handles = [engine.submit(request) for request in requests]
        got = [handle.result(120) for handle in handles]
    finally:
        engine.stop()
    inputs = [request.prompt for request in requests]
    assert got == alone(model, names, lambda row: model.generate(input_ids=torch.tensor([inputs[row]]), do_sample=False,
                                                                 max_new_tokens=8)[0, len(inputs[row]):].tolist())
