"""Passes as plain functions (model/llama_pass.py) against the model's own passes: the same logits,
bit for bit, LoRA on and in draft passes; the model's own modules wherever the functions would differ."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

import hf_invisiblelora  # noqa: F401
from tiny import ADAPTERS, COMMON, prompts, tiny_peft, with_adapters

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]
LENGTHS = [5, 9, 3, 7, 9, 1, 6]


def model_of(arch):
    if arch.startswith("mistral"):  # a window of 4 slides in these prompts
        torch.manual_seed(0)
        config = MistralConfig(vocab_size=64, sliding_window=4 if arch == "mistral_window" else None, **COMMON)
        return with_adapters(MistralForCausalLM(config).double().eval(), ADAPTERS, 0.6)
    return tiny_peft(arch, strength=0.6)


def passes(monkeypatch, model, direct: bool, **options):
    """(sequences, [(drafter or None, ran as plain functions, logits)] of every pass) of a greedy call;
    ``direct=False``: every pass the model's own."""
    from hf_invisiblelora.decode import session
    from hf_invisiblelora.model import forward

    if not direct:
        monkeypatch.setattr(session, "direct_pass", lambda *a: None)
    seen, real = [], forward.EagerForward.__call__

    def call(self, ids, start, kv_len, keep, drafter=None, prefix=None, **kw):
        out = real(self, ids, start, kv_len, keep, drafter=drafter, prefix=prefix, **kw)
        seen.append((drafter, prefix is None and drafter in self.direct, out))
        return out
    monkeypatch.setattr(forward.EagerForward, "__call__", call)
    ids, mask = prompts(LENGTHS)
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=ROWS, do_sample=False, max_new_tokens=12,
                         invisible_lora=True, **options)
    monkeypatch.undo()
    return out, seen


def stock(model):
    ids, mask = prompts(LENGTHS)
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=ROWS, do_sample=False, max_new_tokens=12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mistral_window"])
@pytest.mark.parametrize("draft_dtype", [None, torch.int4, torch.bfloat16])
def test_passes_as_plain_functions_give_the_models_own_logits(monkeypatch, arch, draft_dtype):
    """Every pass but the prompts' runs as plain functions on Llama, Qwen2 and Mistral (a sliding
    window too), LoRA on (each row its adapter) and in draft passes (the base model as it is, or its
    low-precision copies), and every pass gives the logits the model's own pass gives, bit for bit."""
    model = model_of(arch)
    ref = stock(model)
    options = dict(gate="always", num_draft_tokens=3, draft_dtype=draft_dtype)
    fast_out, fast = passes(monkeypatch, model, True, **options)
    own_out, own = passes(monkeypatch, model, False, **options)
    assert torch.equal(fast_out, ref) and torch.equal(own_out, ref)
    assert not any(direct for _, direct, _ in own)
    assert [direct for _, direct, _ in fast].count(False) == 1  # the prompt's pass
    assert any(d is not None for d, _, _ in fast) and any(d is None and direct for d, direct, _ in fast)
    assert len(fast) == len(own) and all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(fast, own))


@pytest.mark.parametrize("case", ["hook", "subclass", "eager", "gemma3"])
def test_the_models_own_modules_run_where_plain_functions_would_differ(monkeypatch, case):
    """Where the model is not exactly what llama_pass.py mirrors (a user's hook sees the pass, a
    subclass's forward, another attention implementation, another architecture),
    every pass runs the model's own modules; the output is stock's either way."""
    model = tiny_peft("gemma3" if case == "gemma3" else "llama", strength=0.6)
    inner = model.get_base_model()
    if case == "hook":
        inner.model.layers[1].post_attention_layernorm.register_forward_hook(lambda m, a, out: None)
    if case == "subclass":
        norm = inner.model.layers[0].input_layernorm
        norm.__class__ = type("Scaled", (type(norm),), {"forward": lambda self, x: 2 * super(type(self), self).forward(x)})
    if case == "eager":
        inner.config._attn_implementation = "eager"
    ref = stock(model)
    out, seen = passes(monkeypatch, model, True, gate="always", num_draft_tokens=2, draft_dtype=torch.int4)
    assert torch.equal(out, ref)
    assert seen and not any(direct for _, direct, _ in seen)
