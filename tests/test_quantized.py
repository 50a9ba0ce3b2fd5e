"""LoRA on quantized base models (hf_invisiblelora/model/quantized.py) on the CPU: torchao weight-only
int8 / int4 and bitsandbytes 4-bit / 8-bit give stock PEFT's greedy tokens on the same quantized
model (or leave them only at near ties of stock's logits: the verify pass runs several tokens per
row, matmuls of other shapes); the quantizations not served are refused up front."""

import random

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.torchao import TorchaoLoraLinear
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_invisiblelora  # noqa: F401  (generate(..., invisible_lora=True))
from hf_invisiblelora.kernels import packed_linear
from hf_invisiblelora.lora import layer as lora_layer
from hf_invisiblelora.lora.bank import get_bank
from hf_invisiblelora.model.context import PassContext
from hf_invisiblelora.model.state import state_of
from hf_invisiblelora.model.walk import lora_layers
from tiny import ADAPTERS, ARCHS, COMMON, all_near_ties, divergences, prompts, with_adapters

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]
# torchao configs on the CPU; int4 in groups of 32 inputs (the tiny models' hidden size).
TORCHAO = {
    "int8": (lambda ao: ao.Int8WeightOnlyConfig(), "Int8Tensor"),
    "int4": (lambda ao: ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(32)),
             "IntxUnpackedToInt8Tensor"),
}


def lengths(seed: int) -> list:
    return random.Random(seed).choices(range(1, 10), k=len(ROWS))


def torchao_model(kind: str, dtype, head: bool = True, seed: int = 0):
    """A tiny Llama quantized by torchao (``head``: the output head too), then given LoRA adapters."""
    ao = pytest.importorskip("torchao.quantization")
    torch.manual_seed(seed)
    base = ARCHS["llama"](64).to(dtype).eval()
    config, weight = TORCHAO[kind]
    ao.quantize_(base, config(ao), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and (head or fqn != "lm_head"))
    model = with_adapters(base, ADAPTERS, strength=0.6)
    assert all(type(m) is TorchaoLoraLinear and type(m.get_base_layer().weight).__name__ == weight
               for m in lora_layers(model))
    return model


def decode(model, ids, mask, names, mixed=True, **kw):
    given = dict(adapter_names=names) if mixed else {}
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **{"max_new_tokens": 12, **given, **kw})


def assert_stock_tokens(model, ids, mask, names, mixed=True, **kw):
    """Our greedy tokens against stock PEFT's on the same model (see the module docstring); returns our output."""
    stock = decode(model, ids, mask, names, mixed, output_logits=True, return_dict_in_generate=True)
    ours = decode(model, ids, mask, names, mixed, invisible_lora=True, gate="always", return_dict_in_generate=True, **kw)
    diverged = divergences(model, names, stock, ours.sequences, mask, ids.shape[1])
    assert all_near_ties(diverged), f"divergences (step, gap, stock's noise) not at near ties: {diverged}"
    return ours


@pytest.mark.parametrize("kind", list(TORCHAO))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_torchao_mixed_batch(kind, dtype, seed):
    model = torchao_model(kind, dtype, seed=seed)
    ids, mask = prompts(lengths(seed), seed=seed)
    out = assert_stock_tokens(model, ids, mask, ROWS, num_draft_tokens=1 + 2 * seed)
    assert 0 < sum(out.stats.accepted) < sum(out.stats.drafted)  # the quantized base drafted, the adapters disagreed


@pytest.mark.parametrize("kind", list(TORCHAO))
def test_torchao_one_active_adapter(kind):
    """Without adapter_names PEFT adds the LoRA term in the adapter's dtype (float32 on this bfloat16 model)."""
    model = torchao_model(kind, torch.bfloat16)
    model.set_adapter("b")
    ids, mask = prompts(lengths(2), seed=2)
    assert_stock_tokens(model, ids, mask, ["b"] * len(ROWS), mixed=False)


@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("options", [dict(lora_backend="peft"), dict(prepack=True), dict(draft_dtype=torch.int8),
                                     dict(draft_vocab=20), dict(draft_vocab=20, draft_dtype=torch.int4)])
def test_torchao_options(head, options):
    """The quantized layers compute as they are: no prepacked copies of them (the float head gets
    one), draft_dtype leaves them (it converts the float head), a restricted draft head reads the
    rows of a quantized head's dequantized weight."""
    model = torchao_model("int8", torch.float32, head=head)
    ids, mask = prompts(lengths(3), seed=3)
    assert_stock_tokens(model, ids, mask, ROWS, **options)
    if options.get("prepack"):
        packed, kinds = state_of(model).packed, [f"packed:{f}" for f in packed_linear.formats(torch.float32, "cpu")]
        assert not any(packed.kept(m.get_base_layer(), kind) is not None for m in lora_layers(model) for kind in kinds)
        assert (packed.kept(model.get_base_model().lm_head, kinds[0]) is not None) is not head  # True: the first format


def test_torchao_quantized_after_the_adapters():
    """quantize_ on the PEFT model, its base layers only: PEFT's Linear over torchao weights."""
    ao = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    model = with_adapters(ARCHS["llama"](64).float().eval(), ADAPTERS, strength=0.6)
    ao.quantize_(model, ao.Int8WeightOnlyConfig(),
                 filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "lora_" not in fqn)
    assert all(type(m) is LoraLinear and type(m.get_base_layer().weight).__name__ == "Int8Tensor"
               for m in lora_layers(model))
    ids, mask = prompts(lengths(4), seed=4)
    assert_stock_tokens(model, ids, mask, ROWS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama on disk for the quantizers that quantize at load time; 64 wide: bitsandbytes'
    CPU kernels take 4-bit weights in blocks of 64 inputs."""
    path = tmp_path_factory.mktemp("tiny64")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, **{**COMMON, "hidden_size": 64, "intermediate_size": 128})) \
        .save_pretrained(path)
    return path


def test_torchao_through_transformers(saved):
    ao = pytest.importorskip("torchao.quantization")
    from transformers import TorchAoConfig

    base = AutoModelForCausalLM.from_pretrained(saved, quantization_config=TorchAoConfig(ao.Int8WeightOnlyConfig()),
                                                dtype=torch.bfloat16, device_map="cpu").eval()
    model = with_adapters(base, ADAPTERS, strength=0.6)
    assert all(type(m) is TorchaoLoraLinear for m in lora_layers(model))
    ids, mask = prompts(lengths(5), seed=5)
    assert_stock_tokens(model, ids, mask, ROWS)


# bitsandbytes configs (transformers' BitsAndBytesConfig), 8-bit without LLM.int8()'s outlier threshold.
BNB = {
    "bnb-nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bnb-fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "bnb-int8": dict(load_in_8bit=True, llm_int8_threshold=0.0),
}


def bnb_model(saved, kind: str, dtype, **options):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(**{**BNB[kind], **options})
    base = AutoModelForCausalLM.from_pretrained(saved, quantization_config=config, dtype=dtype, device_map="cpu").eval()
    model = with_adapters(base, ADAPTERS)  # strong enough that adding unrounded LoRA terms flips tokens
    assert {type(m).__name__ for m in lora_layers(model)} == {"Linear8bitLt" if kind == "bnb-int8" else "Linear4bit"}
    return model


@pytest.mark.parametrize("kind", list(BNB))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mixed", [True, False])
def test_bitsandbytes(saved, kind, dtype, mixed):
    """PEFT's bitsandbytes layers round each LoRA term to the output's dtype also for one active
    adapter (float32 adapters on the bfloat16 model: the bank must round it there too)."""
    model = bnb_model(saved, kind, dtype)
    model.set_adapter("b")
    ids, mask = prompts(lengths(6), seed=6)
    out = assert_stock_tokens(model, ids, mask, ROWS if mixed else ["b"] * len(ROWS), mixed)
    assert sum(out.stats.accepted) > 0 or not mixed  # "b" alone (every module) keeps none of the base's drafts here


def quantized(saved, kind: str, dtype):
    return bnb_model(saved, kind, dtype) if kind in BNB else torchao_model(kind, dtype)


@pytest.mark.parametrize("kind", [*TORCHAO, *BNB])
@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("path", lora_layer.PATHS)
def test_layer_adds_the_lora_term_as_peft(saved, kind, mixed, path, monkeypatch):
    """One quantized LoRA layer through the bank, bit for bit PEFT's, on both torch paths (``path``:
    gathered, packed): the base output of the layer's own forward, the LoRA term (float32 adapters
    on a bfloat16 model) rounded before it is added or not, as PEFT's layer type does with and
    without adapter_names. The adapters' values make their terms exact in float32 in any order, so
    only that rounding could differ."""
    monkeypatch.setattr(lora_layer, "FORCE_PATH", path)
    model = quantized(saved, kind, torch.bfloat16)
    m = model.get_base_model().model.layers[0].self_attn.v_proj  # adapters s, b, d
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a in m.lora_A:
            m.lora_A[a].weight.copy_(torch.randint(-1, 2, m.lora_A[a].weight.shape, generator=g))
            m.lora_B[a].weight.copy_(torch.randint(-3, 4, m.lora_B[a].weight.shape, generator=g) / 8)
            m.scaling[a] = 1.0
    names = ["s", "b", "__base__", "d"] if mixed else ["b"] * 4
    model.set_adapter("b")
    x = (torch.randint(-64, 65, (len(names), 3, m.in_features), generator=g) / 64).bfloat16()
    bank = get_bank(model)
    context = PassContext(lambda: True)
    with torch.no_grad():
        expected = m(x, adapter_names=names) if mixed else m(x)
        with bank.installed(context, round_delta=mixed), \
                context.running(torch.zeros(len(names), dtype=torch.long), 1, 1, adapters=bank.slots(names)):
            ours = m(x)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("kind", ["int4", "bnb-nf4"])
def test_engine_requests_decode_as_standalone_generate(saved, kind):
    """The serving engine on a quantized model: each request as stock generate() of it alone."""
    from hf_invisiblelora.engine import Engine, Request

    model = quantized(saved, kind, torch.float32)
    g = torch.Generator().manual_seed(0)
    engine = Engine(model, max_batch=3, max_len=64, num_draft_tokens=2, gate="always").start()
    try:
        jobs = [(torch.randint(2, 64, (1 + i % 6,), generator=g).tolist(), ROWS[i % len(ROWS)]) for i in range(8)]
        handles = [engine.submit(Request(prompt, adapter=name, max_tokens=3 + i % 7, temperature=0))
                   for i, (prompt, name) in enumerate(jobs)]
        for (prompt, name), handle in zip(jobs, handles):
            out, ids = handle.result(120), torch.tensor([prompt])
            stock = decode(model, ids, torch.ones_like(ids), [name], max_new_tokens=handle.request.max_tokens,
                           output_logits=True, return_dict_in_generate=True)
            assert all_near_ties(divergences(model, [name], stock, torch.tensor([prompt + out]), torch.ones_like(ids),
                                             len(prompt))), (prompt, name)
    finally:
        engine.stop()


def assert_refused(model, problem):
    ids, mask = prompts([3, 5])
    with pytest.raises(ValueError, match=problem):
        decode(model, ids, mask, ["s", "s"], invisible_lora=True)
    assert state_of(model).bank is None  # refused before the bank was built


def test_torchao_refused_up_front():
    """Activation quantization (also on a layer no adapter targets, here the output head), torchao
    tensors not served, quantized LoRA weights: a ValueError naming the problem before anything runs."""
    ao = pytest.importorskip("torchao.quantization")
    cases = []
    for config, layers, problem in ((ao.Int8DynamicActivationInt8WeightConfig(), None, "quantizes the activations"),
                                    (ao.Int8DynamicActivationInt8WeightConfig(), "lm_head", "quantizes the activations"),
                                    (ao.Float8WeightOnlyConfig(), None, "Float8Tensor")):
        base = ARCHS["llama"](64).float().eval()
        ao.quantize_(base, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and layers in (None, fqn))
        cases.append((with_adapters(base, {"s": ADAPTERS["s"]}), problem))
    model = with_adapters(ARCHS["llama"](64).float().eval(), {"s": ADAPTERS["s"]})
    ao.quantize_(model, ao.Int8WeightOnlyConfig())  # the LoRA weights too
    cases.append((model, "quantized LoRA weights"))
    for model, problem in cases:
        assert_refused(model, problem)


def test_llm_int8_threshold_refused(saved):
    assert_refused(bnb_model(saved, "bnb-int8", torch.float32, llm_int8_threshold=6.0),  # transformers' default
                   r"outlier threshold \(6.0\)")
