"""Adapter bank: whole-model logits through bank + kernels equal PEFT's mixed-batch forward."""

import contextlib
import types

import pytest
import torch
from peft import LoraConfig

from hf_invisiblelora.decode.checks import check_model
from hf_invisiblelora.lora import layer as lora_layer
from hf_invisiblelora.lora.bank import get_bank
from hf_invisiblelora.model.context import PassContext
from tiny import COMMON, tiny_peft

VOCAB = 101
# Different ranks, targets, alphas, rslora: a layer's stack mixes ranks and absent adapters.
ADAPTERS = {
    "math": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "code": dict(r=8, lora_alpha=4, target_modules=["q_proj", "k_proj", "down_proj"], use_rslora=True),
    "chat": dict(r=2, lora_alpha=3, target_modules="all-linear"),
    "poem": dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "up_proj"]),
}


@pytest.fixture(autouse=True, params=lora_layer.PATHS)
def path(request, monkeypatch):
    """Every test on each torch path: packed (decode steps), gathered and runs (prefills)."""
    monkeypatch.setattr(lora_layer, "FORCE_PATH", request.param)
    return request.param


def build(arch="llama", adapters=ADAPTERS, seed=0):
    return tiny_peft(arch, vocab=VOCAB, adapters=adapters, seed=seed)


def peft_logits(pm, ids, names):
    with torch.no_grad():
        return pm(ids, adapter_names=names).logits


DRAFT = types.SimpleNamespace(key="")  # a drafter (its key: drafters.Drafter.key): its passes have LoRA off


@contextlib.contextmanager
def installed(bank):
    context = PassContext(lambda: True)
    with torch.no_grad(), bank.installed(context):
        yield context


def one_pass(context, bank, slots, rows: int):
    """The block is a pass of ``rows`` rows: LoRA on with the rows' adapter ``slots``, or a draft pass (None)."""
    bank.begin_pass()
    return context.running(torch.zeros(rows, dtype=torch.long), 1, 1, adapters=slots,
                           drafter=DRAFT if slots is None else None)


def bank_logits(pm, ids, names):
    bank = get_bank(pm)
    with installed(bank) as context, one_pass(context, bank, None if names is None else bank.slots(names), len(ids)):
        return pm(ids).logits


def assert_same(a, b):
    assert (a - b).abs().max().item() < 1e-9


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("names", [
    ["math", "__base__", "chat", "code", "math", "poem"],  # mixed, a no-LoRA row, a repeat
    ["poem", "poem", "poem"],
    ["__base__", "code"],
    ["chat", "code", "math", "poem", "__base__", "__base__"],  # grouped rows: the sliced path
])
def test_logits_match_peft(arch, names):
    pm = build(arch)
    ids = torch.randint(0, VOCAB, (len(names), 3))
    assert_same(bank_logits(pm, ids, names), peft_logits(pm, ids, names))


def test_no_lora_batch_is_the_base_model():
    pm = build()
    ids = torch.randint(0, VOCAB, (3, 2))
    base = peft_logits(pm, ids, ["__base__"] * 3)
    assert_same(bank_logits(pm, ids, None), base)
    assert_same(bank_logits(pm, ids, ["__base__"] * 3), base)
    assert (base - peft_logits(pm, ids, ["math"] * 3)).abs().max() > 1e-3  # the adapters matter


def test_cache_survives_draft_passes_and_batches_change():
    pm = build()
    bank = get_bank(pm)
    ids = torch.randint(0, VOCAB, (2, 1))
    with installed(bank) as context:
        slots = bank.slots(["math", "code"])
        with one_pass(context, bank, slots, 2):
            pm(ids)
        first = bank.meta_for(slots, 2)
        with one_pass(context, bank, None, 2):  # a draft pass
            pm(ids)
        with one_pass(context, bank, bank.slots(["__base__", "__base__"]), 2):
            pm(ids)
        slots = bank.slots(["code", "math"])
        assert bank.meta_for(slots, 2).cache is first.cache
        with one_pass(context, bank, slots, 2):
            logits = pm(ids).logits
        assert_same(logits, peft_logits(pm, ids, ["code", "math"]))  # outside a pass: PEFT's own layers
        with one_pass(context, bank, bank.slots(["chat", "math"]), 2):
            logits = pm(ids).logits
        assert_same(logits, peft_logits(pm, ids, ["chat", "math"]))


def test_get_bank_follows_add_delete_and_scale():
    pm = build(adapters={k: ADAPTERS[k] for k in ("math", "code")})
    ids = torch.randint(0, VOCAB, (3, 2))
    bank = get_bank(pm)
    assert bank.adapter_names == ["math", "code"]
    version = bank.version
    assert get_bank(pm) is bank and bank.version == version  # no rebuild

    pm.add_adapter("chat", LoraConfig(init_lora_weights=False, **ADAPTERS["chat"]))
    names = ["chat", "math", "code"]
    assert_same(bank_logits(pm, ids, names), peft_logits(pm, ids, names))
    assert get_bank(pm) is bank and bank.adapter_names == ["math", "code", "chat"]

    for layer, _ in bank.layers.items():
        layer.set_scale("math", 0.25)
    names = ["math", "__base__", "chat"]
    assert_same(bank_logits(pm, ids, names), peft_logits(pm, ids, names))

    pm.delete_adapter("code")
    names = ["chat", "math", "chat"]
    assert_same(bank_logits(pm, ids, names), peft_logits(pm, ids, names))
    assert get_bank(pm).adapter_names == ["math", "chat"]


def test_in_place_weight_update_is_picked_up():
    pm = build(adapters={"math": ADAPTERS["math"]})
    ids = torch.randint(0, VOCAB, (1, 2))
    bank_logits(pm, ids, ["math"])
    with torch.no_grad():
        next(m for m in get_bank(pm).layers).lora_B["math"].weight.mul_(3)
    assert_same(bank_logits(pm, ids, ["math"]), peft_logits(pm, ids, ["math"]))


def test_installed_restores_forwards_even_on_error():
    pm = build(adapters={"math": ADAPTERS["math"]})
    bank = get_bank(pm)
    layer = next(iter(bank.layers))
    with pytest.raises(RuntimeError, match="boom"), installed(bank):
        assert "forward" in layer.__dict__
        raise RuntimeError("boom")
    assert "forward" not in layer.__dict__ and bank.context is None


def test_an_input_that_is_not_the_batch_tokens_is_reported():
    pm = build(adapters={"math": ADAPTERS["math"]})
    bank = get_bank(pm)
    with installed(bank) as context, one_pass(context, bank, bank.slots(["math", "math"]), 2), \
            pytest.raises(ValueError, match="got 5 tokens for 2 rows"):
        pm.base_model.model.model.layers[0].self_attn.q_proj(torch.zeros(5, COMMON["hidden_size"], dtype=torch.float64))


@pytest.mark.parametrize("config, problem", [
    (dict(r=4, target_modules=["embed_tokens", "q_proj"], use_dora=True), "LoRA variant"),  # DoRA on Linear only
    (dict(r=4, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
])
def test_unsupported_layers_are_refused(config, problem):
    with pytest.raises(ValueError, match=problem):
        check_model(build(adapters={"math": config}))


def test_merged_adapters_are_refused():
    pm = build(adapters={"math": ADAPTERS["math"]})
    pm.merge_adapter()
    with pytest.raises(ValueError, match="merged"):
        check_model(pm)


def test_siblings_share_one_shrink_only_for_the_same_input(monkeypatch, path):
    pm = build(adapters={"chat": ADAPTERS["chat"], "code": ADAPTERS["code"]})  # chat: all 7 modules
    bank = get_bank(pm)
    shrinks = []
    owner, name = {"gathered": (bank.ops, "lora_shrink"), "packed": (lora_layer, "packed_shrink"),
                   "runs": (lora_layer, "runs_shrink")}[path]
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: shrinks.append(1) or real(*a, **k))
    names = ["code", "chat"]
    ids = torch.randint(0, VOCAB, (2, 3))
    assert_same(bank_logits(pm, ids, names), peft_logits(pm, ids, names))
    assert len(shrinks) == 2 * 4  # per decoder layer: q/k/v, o, gate/up, down

    # Siblings called on different inputs each get their own (correct) shrink.
    attn = pm.base_model.model.model.layers[0].self_attn
    x1, x2 = torch.randn(2, 3, COMMON["hidden_size"], dtype=torch.float64).unbind(0)
    x1, x2 = x1[None].expand(2, 3, -1).contiguous(), x2[None].expand(2, 3, -1).contiguous()
    with torch.no_grad():
        expected = attn.q_proj(x1, adapter_names=names), attn.k_proj(x2, adapter_names=names)
        with installed(bank) as context, one_pass(context, bank, bank.slots(names), 2):
            got = attn.q_proj(x1), attn.k_proj(x2)
    assert_same(got[0], expected[0])
    assert_same(got[1], expected[1])


def test_greedy_decoding_matches_peft():
    """Prefill (5 tokens per row) then 1-token steps with a KV cache: same tokens as stock PEFT."""
    pm = build("qwen2")
    names = ["poem", "__base__", "code", "chat"]
    prompt = torch.randint(0, VOCAB, (len(names), 5))

    def greedy(step):
        ids, cache, tokens = prompt, None, []
        for _ in range(6):
            out = step(ids, cache)
            cache, ids = out.cache, out.logits[:, -1:].argmax(-1)
            tokens.append(ids)
        return torch.cat(tokens, 1)

    with torch.no_grad():
        expected = greedy(lambda ids, cache: pm(ids, cache=cache, use_cache=True, adapter_names=names))
        bank = get_bank(pm)
        with installed(bank) as context:
            def bank_step(ids, cache):
                with one_pass(context, bank, bank.slots(names), len(names)):
                    return pm(ids, cache=cache, use_cache=True)
            got = greedy(bank_step)
    assert torch.equal(got, expected)
