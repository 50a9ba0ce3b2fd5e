"""Issue 25's adapter and base kinds on the real SmolLM2-135M-Instruct (the zoo's base, converted
from the GGUF file of a PyPI wheel: ``hf_invisiblelora.zoo.assets``), against stock decoding:

- float64, exact: DoRA, ``modules_to_save`` (the final norm), embedding LoRA and plain LoRA rows
  with a ``__base__`` row in one mixed batch, each row as stock generate() decodes it alone with
  its adapter active (stock PEFT cannot mix DoRA); a chat's next turn continued from the returned
  cache, as stock continues its own;
- float32, the torchao weight-only int8 / int4 base quantized on loading (transformers'
  ``TorchAoConfig``): stock PEFT's mixed batch on the same quantized model, divergences only at
  near ties of stock's logits (tools/tiny.py).

The adapters are random (seeded), so no training runs here; the zoo's trained DoRA and
modules_to_save adapters are shown by the demo (docs/zoo.md). Skipped only where the base model
cannot be had (no zoo extra, no network for its wheel).
"""

import pytest
import torch

import hf_invisiblelora  # noqa: F401  (generate(..., invisible_lora=True))
from hf_invisiblelora.model.walk import BASE
from tiny import all_near_ties, divergences, with_adapters

pytestmark = pytest.mark.slow

zoo = pytest.importorskip("hf_invisiblelora.zoo", reason="the zoo extra is not installed")

ADAPTERS = {
    "dora": dict(r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "norm": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["model.norm"]),
    "embed": dict(r=8, lora_alpha=8, target_modules=["embed_tokens", "o_proj"]),
    "plain": dict(r=16, lora_alpha=32, use_rslora=True, target_modules="all-linear"),
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is two plus three?\nA:",
    "In the beginning God created",
    "To be, or not to be:",
]
ROWS = ["dora", "norm", "embed", BASE, "plain", "dora"]
NEW = 10


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.padding_side = "left"
    return tok


def load(path, dtype, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()


def perturbed(model, seed=0, spread=0.05, embedding=0.01):
    """DoRA magnitudes moved off the weights' norms and the norm's copy off the original, so each
    kind changes the output by more than its LoRA term (otherwise DoRA would decode as LoRA); the
    embedding LoRA's B (random normal, which with_adapters does not scale) made as small as the rest."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name or "modules_to_save" in name:
                p.mul_(1 + spread * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif "lora_embedding_B" in name:
                p.mul_(embedding)
    return model


def alone(model, tok, rows, prompts, **kw):
    """Stock generate() of each prompt alone (no padding) with its row's adapter active: new tokens."""
    out = []
    with torch.no_grad():
        for name, prompt in zip(rows, prompts):
            enc = tok([prompt], return_tensors="pt")
            if name == BASE:
                with model.disable_adapter():
                    seq = model.generate(**enc, do_sample=False, **kw)
            else:
                model.set_adapter(name)
                seq = model.generate(**enc, do_sample=False, **kw)
            out.append(seq[0, enc.input_ids.shape[1]:].tolist())
    return out


def new_tokens(sequences, width, pad):
    """Each row's new tokens with the batch's trailing padding (after a row's EOS) cut."""
    rows = []
    for seq in sequences[:, width:].tolist():
        while seq and seq[-1] == pad:
            seq.pop()
        rows.append(seq)
    return rows


@pytest.fixture(scope="module")
def kinds(smollm2_path):
    torch.manual_seed(0)
    return perturbed(with_adapters(load(smollm2_path, torch.float64), ADAPTERS, strength=0.05))


@pytest.mark.parametrize("k", [1, 3])
def test_dora_norm_embedding_and_lora_rows_in_one_batch(kinds, tokenizer, k):
    kw = dict(max_new_tokens=NEW, pad_token_id=tokenizer.pad_token_id)
    expected = alone(kinds, tokenizer, ROWS, PROMPTS, **kw)
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = kinds.generate(**enc, adapter_names=ROWS, do_sample=False, invisible_lora=True, num_draft_tokens=k,
                             gate="always", return_dict_in_generate=True, **kw)
    got = new_tokens(out.sequences, enc.input_ids.shape[1], tokenizer.pad_token_id)
    assert [g[:len(e)] for g, e in zip(got, expected)] == expected
    assert sum(out.stats.accepted) > 0  # the base drafted and was kept where it agreed
    # The adapters moved their rows off the base model's tokens (else the comparison shows little).
    base = alone(kinds, tokenizer, [BASE] * len(PROMPTS), PROMPTS, **kw)
    moved = [name for name, e, b in zip(ROWS, expected, base) if name != BASE and e != b]
    assert len(moved) >= len(ROWS) - 2, moved


def test_next_chat_turn_continues_the_returned_cache(smollm2_path, tokenizer):
    """Two turns of a chat (its template) in a mixed batch stock PEFT can run (no DoRA, and no
    modules_to_save norm: PEFT mixes Linear, Embedding and Conv copies only): the second turn passes
    the first's cache; ours continues ours, and a copy of stock's, as stock continues stock's."""
    import copy

    torch.manual_seed(2)
    kinds = perturbed(with_adapters(load(smollm2_path, torch.float64), {n: ADAPTERS[n] for n in ("embed", "plain")},
                                    strength=0.05))
    rows = ["embed", BASE, "plain"]
    chats = [[{"role": "user", "content": q}] for q in ("Name a colour.", "What is 2+2?", "Say hello in French.")]
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
              adapter_names=rows)

    def run(enc, cache=None, invisible=False):
        extra = dict(invisible_lora=True, num_draft_tokens=3, gate="always") if invisible else {}
        with torch.no_grad():
            return kinds.generate(**enc, **kw, **extra, **({} if cache is None else {"past_key_values": cache}))

    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    stock, ours = run(enc), run(enc, invisible=True)
    assert torch.equal(ours.sequences, stock.sequences)
    follow = tokenizer(["\nAnd another?"] * len(rows), return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat([stock.sequences, follow], 1)
    mask = torch.cat([enc.attention_mask, torch.ones(len(rows), ids.shape[1] - enc.input_ids.shape[1],
                                                     dtype=enc.attention_mask.dtype)], 1)
    # Stock's padded steps after a row's EOS are part of its sequence and its cache; they stay masked in.
    second = dict(input_ids=ids, attention_mask=mask)
    copied = copy.deepcopy(stock.past_key_values)
    stock2 = run(second, stock.past_key_values)
    assert torch.equal(run(second, ours.past_key_values, invisible=True).sequences, stock2.sequences)
    assert torch.equal(run(second, copied, invisible=True).sequences, stock2.sequences)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_torchao_quantized_base(smollm2_path, tokenizer, quantize):
    ao = pytest.importorskip("torchao.quantization", reason="the quant extra is not installed")
    from transformers import TorchAoConfig

    config = TorchAoConfig(zoo.QUANTIZATIONS[quantize](ao, torch))
    torch.manual_seed(1)
    model = with_adapters(load(smollm2_path, torch.float32, quantization_config=config),
                          {n: ADAPTERS[n] for n in ("embed", "plain")} | {"attn": dict(r=4, lora_alpha=8)},
                          strength=0.02)
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight).__module__.startswith("torchao")
    rows = ["plain", "attn", BASE, "embed", "plain", "attn"]
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(adapter_names=rows, do_sample=False, max_new_tokens=NEW, pad_token_id=tokenizer.pad_token_id,
              return_dict_in_generate=True)
    with torch.no_grad():
        stock = model.generate(**enc, output_logits=True, **kw)
        ours = model.generate(**enc, invisible_lora=True, num_draft_tokens=3, gate="always", **kw)
    diverged = divergences(model, rows, stock, ours.sequences, enc.attention_mask, enc.input_ids.shape[1])
    assert all_near_ties(diverged), f"divergences (step, gap, stock's noise) not at near ties: {diverged}"
    assert len(diverged) < len(rows) and sum(ours.stats.accepted) > 0


@pytest.mark.parametrize("edit", ["down_columns", "neurons"])
def test_prepacked_weights_follow_a_permutation(smollm2_path, tokenizer, edit):
    """After a warm call, one layer's down_proj columns permuted through ``.data`` (every row keeps
    its values and their sum; no version counter moves), or its MLP neurons (gate / up rows with
    down columns, stock's output unchanged up to rounding): ours decodes as stock on the edited model
    (prepacked float32 layers: divergences only at near ties)."""
    torch.manual_seed(3)
    model = with_adapters(load(smollm2_path, torch.float32), {n: ADAPTERS[n] for n in ("embed", "plain")},
                          strength=0.02)
    rows = ["plain", BASE, "embed", "plain"]
    enc = tokenizer(PROMPTS[:4], return_tensors="pt", padding=True)
    kw = dict(adapter_names=rows, do_sample=False, max_new_tokens=NEW, pad_token_id=tokenizer.pad_token_id,
              return_dict_in_generate=True)
    with torch.no_grad():
        model.generate(**enc, invisible_lora=True, prepack=True, **kw)  # the copies are made
        mlp = model.base_model.model.model.layers[5].mlp
        perm = torch.randperm(mlp.down_proj.in_features, generator=torch.Generator().manual_seed(0))
        edits = [(mlp.down_proj, 1)] + ([(mlp.gate_proj, 0), (mlp.up_proj, 0)] if edit == "neurons" else [])
        for proj, axis in edits:
            w = proj.get_base_layer().weight
            w.data.copy_(w.data.index_select(axis, perm))
        stock = model.generate(**enc, output_logits=True, **kw)
        ours = model.generate(**enc, invisible_lora=True, prepack=True, num_draft_tokens=3, gate="always", **kw)
    diverged = divergences(model, rows, stock, ours.sequences, enc.attention_mask, enc.input_ids.shape[1])
    assert all_near_ties(diverged), f"divergences (step, gap, stock's noise) not at near ties: {diverged}"
