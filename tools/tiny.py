"""Tiny random models, adapters, prompts and a tokenizer for tests, benchmarks and tools, built in
memory (no downloads), like ``transformers.testing_utils``; not installed with the package (pytest and
benchmarks/common.py put tools/ on the import path).

- ``tiny_peft``: tiny Llama / Qwen2 / Gemma 3 models with LoRA adapters of different ranks,
  targets, alpha and rslora; ``prompts``: left-padded random prompts; ``tiny_tokenizer``.
- ``smollm2_shaped`` / ``synthetic_zoo``: SmolLM2-135M's shape with random weights and adapters
  (benchmarks that need a real model's costs but no files).
- ``chi_square_p``, ``divergences`` / ``all_near_ties``: the statistical and low-precision checks.
The architecture sweep is arch_sweep.py.
"""

from __future__ import annotations

import math

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# Tiny Llama / Qwen2 / Gemma 3 with LoRA adapters.
PAD, EOS = 0, 1
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
ARCHS = {
    "llama": lambda v: LlamaForCausalLM(LlamaConfig(vocab_size=v, **COMMON)),
    "qwen2": lambda v: Qwen2ForCausalLM(Qwen2Config(vocab_size=v, **COMMON)),
    # A window of 5 makes the sliding-window layers really slide in short tests.
    "gemma3": lambda v: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=v, head_dim=8, sliding_window=5, layer_types=["sliding_attention", "full_attention"], **COMMON)),
}
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Different ranks, targets, alpha and rslora, as public adapters differ.
ADAPTERS = {
    "s": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=8, target_modules=LINEAR),
    "c": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "down_proj"]),
    "d": dict(r=16, lora_alpha=16, target_modules=["up_proj", "v_proj"]),
}


def with_adapters(base, adapters: dict, strength: float = 1.0):
    """``base`` wrapped by PEFT with ``adapters`` ({name: LoraConfig kwargs}), random B weights scaled
    by ``strength`` (so they change the output: larger moves it further from the base model)."""
    model = None
    for name, kwargs in adapters.items():
        config = LoraConfig(**{"init_lora_weights": False, **kwargs})
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(strength)
    return model.eval()


def tiny_peft(arch="llama", vocab=64, adapters=("s", "b", "c", "d"), strength=1.0, seed=0, dtype=torch.float64):
    """A tiny random model with LoRA adapters: names from ADAPTERS, or a dict {name: LoraConfig kwargs}."""
    torch.manual_seed(seed)
    base = ARCHS[arch](vocab).to(dtype).eval()
    adapters = adapters if isinstance(adapters, dict) else {n: ADAPTERS[n] for n in adapters}
    return with_adapters(base, adapters, strength)


def prompts(lengths, vocab=64, seed=0, low=2):
    """Left-padded random prompts of the given lengths (token ids from ``low``): (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(low, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def tiny_tokenizer():
    """A character-level BPE tokenizer trained in memory (<pad> = 0, <eos> = 1), left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = ["the quick brown fox jumps over the lazy dog", "once upon a time there was a cat", "hello world"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=64, special_tokens=["<pad>", "<eos>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def chi_square_p(samples: list, dist: dict) -> float:
    """p-value of a chi-square test that ``samples`` come from ``dist`` ({outcome: probability}).
    Rare cells are merged so every expected count is >= 5; a sample outside the support gives 0."""
    from scipy.stats import chisquare

    cells = sorted(dist, key=dist.get)
    observed = [sum(1 for s in samples if s == c) for c in cells]
    if sum(observed) < len(samples):
        return 0.0  # a sample outside the target's support is impossible under the target
    total = sum(dist.values())  # 1 up to rounding, which scipy's chisquare checks against the counts
    expected = [dist[c] / total * len(samples) for c in cells]
    obs, exp, o, e = [], [], 0, 0.0
    for oi, ei in zip(observed, expected):
        o, e = o + oi, e + ei
        if e >= 5:
            obs.append(o), exp.append(e)
            o, e = 0, 0.0
    obs[-1] += o
    exp[-1] += e
    return 1.0 if len(obs) == 1 else chisquare(obs, exp).pvalue


def spacing(x: float, dtype) -> float:
    """The distance between neighbouring numbers of ``dtype`` at magnitude |x|."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - mantissa)


NEAR_TIE_UNITS = 4


def divergences(model, names, stock, ours, mask, prompt_len: int) -> dict:
    """Where ``ours`` leaves ``stock``'s greedy tokens, and how close to a tie stock was there.

    ``stock``: generate(..., output_logits=True, return_dict_in_generate=True) output; ``ours``:
    sequences; ``names``: each row's adapter; ``mask``: the prompts' attention mask. Returns {row:
    (step, gap, noise)}: the first differing step; stock's logit of its token minus its logit of ours
    there; and how much that margin moves when stock computes the row's prefix alone (a batch of
    one, no padding) instead of in its batch; both in units of the model dtype's spacing at that
    logit. A divergence is at a near tie if gap <= max(NEAR_TIE_UNITS, noise): stock itself could
    have chosen either token.
    """
    out = {}
    seqs = stock.sequences
    for row in range(seqs.shape[0]):
        a, b = seqs[row, prompt_len:].tolist(), ours[row, prompt_len:].tolist()
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None:
            continue
        a, b = a[step], b[step]
        logits = stock.logits[step][row].float()
        unit = spacing(float(logits[a]), model.dtype)
        prefix = seqs[row, : prompt_len + step][torch.cat([mask[row].bool(), mask.new_ones(step, dtype=torch.bool)])]
        with torch.no_grad():
            alone = model(input_ids=prefix[None], adapter_names=[names[row]]).logits[0, -1].float()
        gap = float(logits[a] - logits[b])
        out[row] = (step, gap / unit, abs(gap - float(alone[a] - alone[b])) / unit)
    return out


def all_near_ties(diverged: dict) -> bool:
    return all(gap <= max(NEAR_TIE_UNITS, noise) for _, gap, noise in diverged.values())


# SmolLM2-135M's shape with random weights.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
# Its linear layers' sizes, for the benchmarks that time layers of that shape alone.
SMOLLM2_DIMS = dict(layers=30, hidden=576, intermediate=1536, vocab=49152, kv=576 // 9 * 3)


def smollm2_shaped(adapters: dict, strength: float = 1.0, seed: int = 0):
    """SmolLM2-135M's shape (float32, random weights) with ``adapters`` ({name: LoraConfig kwargs})."""
    torch.manual_seed(seed)
    return with_adapters(LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).eval(), adapters, strength)


def synthetic_zoo(strength: float, n_adapters: int = 16, prompt_len: int = 32):
    """SmolLM2-135M's shape with random weights and random LoRA adapters (ranks 8-64, attention-only
    or all 7 linear modules): needs no files, so it runs where the zoo cannot travel (a lent GPU).
    Speeds are those of the real shape; acceptance follows ``strength`` (the scale of the adapters'
    random B weights), not real text. Returns (model, adapter names, prompts_for(name, n, seed))."""
    names = [f"synthetic{i}" for i in range(n_adapters)]
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(n_adapters)]
    model = smollm2_shaped({name: dict(r=r, lora_alpha=r, target_modules=LINEAR if i % 2 else LINEAR[:4])
                            for i, (name, r) in enumerate(zip(names, ranks))}, strength)

    def prompts_for(name, n, seed):
        g = torch.Generator().manual_seed(1000 * names.index(name) + seed)
        return torch.randint(3, SMOLLM2_135M["vocab_size"], (n, prompt_len), generator=g).tolist()

    return model, names, prompts_for


def json_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (every byte a token, merges from JSON-like text; <pad> = 0, <eos> =
    1), left padding: it can spell any text, so grammars over JSON, regexes and EBNF apply to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ['{"name": "ada", "age": 36, "tags": ["a", "b"], "ok": true, "none": null}',
            '[1, 2, 3.5, -4e2, "x", {"y": false}]', "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")
