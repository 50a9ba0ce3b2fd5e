"""Bad input gets a clear ValueError, and the model is left exactly as it was."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_invisiblelora
from hf_invisiblelora.model.walk import lora_layers
from tiny import ARCHS, prompts, tiny_peft

IDS, MASK = prompts([3, 5])


def snapshot(model):
    """Everything a failed call could leave changed."""
    layers = lora_layers(model)
    with torch.no_grad():
        logits = model(input_ids=IDS, attention_mask=MASK).logits  # the active adapter (works merged / training too)
    return dict(
        logits=logits,
        disabled=[m._disable_adapters for m in layers],
        hooks=[len(m._forward_pre_hooks) + len(m._forward_hooks) for m in layers],
        forwards=["forward" in vars(m) for m in layers],
        grad=[p.requires_grad for p in model.parameters()],
        training=model.training,
        active=list(model.active_adapters),
    )


def assert_unchanged(model, before):
    after = snapshot(model)
    assert torch.equal(after.pop("logits"), before.pop("logits"))
    assert after == before


def call(model, **kw):
    args = dict(input_ids=IDS, attention_mask=MASK, adapter_names=["s", "b"], max_new_tokens=4, invisible_lora=True)
    args.update(kw)
    return model.generate(**args)


@pytest.fixture
def model():
    return tiny_peft("llama", adapters=("s", "b"))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(adapter_names=["s", "nope"]), r"Unknown adapter\(s\) \['nope'\]; loaded adapters: \['s', 'b'\]"),
        (dict(adapter_names=["s"]), "adapter_names has 1 entries but the batch has 2 rows"),
        (dict(adapter_names="s"), "must be a list of adapter names"),
        (dict(num_beams=2), "beam search"),
        (dict(prompt_lookup_num_tokens=3), "cannot be combined with prompt_lookup_num_tokens"),
        (dict(output_attentions=True, return_dict_in_generate=True), "does not return"),
        (dict(gate="sometimes"), "gate must be one of"),
        (dict(num_draft_tokens=-1), "num_draft_tokens must be"),
        (dict(stop_strings=["x"]), "stop_strings needs the tokenizer"),
    ],
)
def test_bad_arguments(model, kw, message):
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        call(model, **kw)
    assert_unchanged(model, before)


def test_assistant_model_refused(model):
    before = snapshot(model)
    with pytest.raises(ValueError, match="assistant_model"):
        call(model, assistant_model=model.get_base_model())
    assert_unchanged(model, before)


def test_not_a_peft_model():
    base = ARCHS["llama"](64).double().eval()
    with pytest.raises(ValueError, match="needs a PEFT model with LoRA adapters, got LlamaForCausalLM"):
        hf_invisiblelora.generate(base, IDS, attention_mask=MASK, max_new_tokens=3)


def test_training_mode(model):
    model.train()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        call(model)
    assert_unchanged(model, before)


def test_merged_adapter(model):
    model.set_adapter("s")
    model.merge_adapter()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"merged into the base weights.*unmerge_adapter\(\)"):
        call(model)
    assert_unchanged(model, before)
    assert any(m.merged for m in lora_layers(model))  # still merged: nothing was undone


@pytest.mark.parametrize("config", [
    dict(r=4, target_modules=["embed_tokens", "q_proj"], use_dora=True),  # DoRA is served on Linear layers only
    dict(r=4, target_modules=["q_proj"], alora_invocation_tokens=[5]),
], ids=["dora-embedding", "alora"])
def test_variants_refused(config):
    base = ARCHS["llama"](64).double().eval()
    model = get_peft_model(base, LoraConfig(**config), adapter_name="s").eval()
    with pytest.raises(ValueError, match="variants"):
        model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=3, invisible_lora=True)


def test_options_without_the_flag(model):
    with pytest.raises(ValueError, match=r"\['num_draft_tokens'\] only apply with invisible_lora=True"):
        model.generate(input_ids=IDS, attention_mask=MASK, adapter_names=["s", "b"], num_draft_tokens=2)


class Boom(StoppingCriteria):
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_exception_mid_decoding_restores_the_model(model):
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        call(model, max_new_tokens=10, stopping_criteria=StoppingCriteriaList([Boom()]))
    assert_unchanged(model, before)


def test_wrong_length_then_a_good_call(model):
    """PEFT leaks its adapter_names hooks when its own length check fails; ours checks first."""
    with pytest.raises(ValueError):
        call(model, adapter_names=["s", "b", "s"])
    good = call(model, do_sample=False)
    ref = model.generate(input_ids=IDS, attention_mask=MASK, adapter_names=["s", "b"], max_new_tokens=4, do_sample=False)
    assert torch.equal(good, ref)


def test_stock_failure_leaves_no_peft_hooks(model):
    """PEFT's own generate leaks its adapter_names hooks when a forward fails; the flag's wrapper cleans up."""
    before = snapshot(model)
    with pytest.raises(ValueError, match="Length of `adapter_names`|same as the number of inputs"):
        model.generate(input_ids=IDS, attention_mask=MASK, adapter_names=["s", "b", "s"], max_new_tokens=3)
    assert_unchanged(model, before)
    ref = model.generate(input_ids=IDS, attention_mask=MASK, adapter_names=["s", "b"], max_new_tokens=4, do_sample=False)
    assert torch.equal(call(model, do_sample=False), ref)
