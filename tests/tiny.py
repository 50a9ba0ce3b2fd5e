"""Tiny random models, adapters, prompts and a tokenizer, built in memory (no downloads)."""

from __future__ import annotations

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

PAD, EOS = 0, 1
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)

ARCHS = {
    "llama": lambda v: LlamaForCausalLM(LlamaConfig(vocab_size=v, **COMMON)),
    "qwen2": lambda v: Qwen2ForCausalLM(Qwen2Config(vocab_size=v, **COMMON)),
    # A window of 5 makes the sliding-window layers really slide in these short tests.
    "gemma3": lambda v: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=v, head_dim=8, sliding_window=5, layer_types=["sliding_attention", "full_attention"], **COMMON)),
}

# Different ranks, targets, alpha and rslora, as public adapters differ.
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "c": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "down_proj"]),
    "d": dict(r=16, lora_alpha=16, target_modules=["up_proj", "v_proj"]),
}


def tiny_peft(arch="llama", vocab=64, adapters=("a", "b", "c", "d"), strength=1.0, seed=0, dtype=torch.float64):
    """A tiny random model with LoRA adapters whose B weights are random (so they change the output).

    ``strength`` scales the B weights: larger adapters move the output further from the base
    model, so fewer drafts are accepted.
    """
    torch.manual_seed(seed)
    base = ARCHS[arch](vocab).to(dtype).eval()
    first, *rest = adapters
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **ADAPTERS[first]), adapter_name=first)
    for name in rest:
        model.add_adapter(name, LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(strength)
    return model.eval()


def prompts(lengths, vocab=64, seed=0):
    """Left-padded random prompts of the given lengths: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(2, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def tiny_tokenizer():
    """A character-level BPE tokenizer trained in memory (<pad> = 0, <eos> = 1), left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = ["the quick brown fox jumps over the lazy dog", "once upon a time there was a cat", "hello world"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=64, special_tokens=["<pad>", "<eos>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")
