"""Greedy InvisibleLoRA output is token-identical to standard PEFT multi-LoRA decoding (float64)."""

import gc

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_invisiblelora
from hf_invisiblelora.model.state import state_of
from tiny import ARCHS, PAD, prompts, tiny_peft

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]
LENGTHS = [5, 9, 3, 7, 9, 1, 6]


def standard(model, ids, mask, names, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False, **kw)


def invisible(model, ids, mask, names, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False,
                          invisible_lora=True, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_identical_to_standard_decoding(arch, k):
    model = tiny_peft(arch, strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = standard(model, ids, mask, ROWS, max_new_tokens=14)
    out = invisible(model, ids, mask, ROWS, max_new_tokens=14, num_draft_tokens=k, gate="always",
                    return_dict_in_generate=True)
    for row in range(len(ROWS)):
        assert out.sequences[row].tolist() == ref[row].tolist(), f"row {row} ({ROWS[row]})"
    drafted, accepted = sum(out.stats.drafted), sum(out.stats.accepted)
    assert 0 < accepted < drafted  # the adapters really disagree with the base model sometimes


@pytest.mark.parametrize("gate", ["auto", "never"])
def test_gate_settings_do_not_change_output(gate):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = standard(model, ids, mask, ROWS, max_new_tokens=10)
    out = invisible(model, ids, mask, ROWS, max_new_tokens=10, gate=gate, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    if gate == "never":
        assert out.stats.draft_passes == 0 and sum(out.stats.drafted) == 0


def test_all_base_rows_never_draft_with_the_base_model_itself():
    """Rows without an adapter: the base model as it is has nothing to save them (its draft pass is
    their plain step) and never drafts, not even to calibrate; cheaper drafters (its int8 / int4
    copies, prompt lookup) are speculative decoding of the base model and may, where the gate finds
    they pay."""
    model = tiny_peft("llama")
    ids, mask = prompts([4, 6])
    ref = standard(model, ids, mask, ["__base__"] * 2, max_new_tokens=6)
    out = invisible(model, ids, mask, ["__base__"] * 2, max_new_tokens=6, draft_dtype=None, prompt_lookup=False,
                    return_dict_in_generate=True)
    assert out.stats.draft_passes == 0 and torch.equal(out.sequences, ref)
    out = invisible(model, ids, mask, ["__base__"] * 2, max_new_tokens=6, return_dict_in_generate=True)
    assert "" not in out.stats.drafter_per_cycle and torch.equal(out.sequences, ref)


def test_eos_mid_batch_and_several_eos_ids():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    free = standard(model, ids, mask, ROWS, max_new_tokens=12)
    # Two tokens the rows really produce mid-way become EOS ids: rows stop at different steps.
    new = free[:, ids.shape[1]:]
    eos = [int(new[0, 3]), int(new[3, 5])]
    ref = standard(model, ids, mask, ROWS, max_new_tokens=12, eos_token_id=eos)
    out = invisible(model, ids, mask, ROWS, max_new_tokens=12, eos_token_id=eos, num_draft_tokens=3,
                    return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert ref.shape[1] < free.shape[1] or (ref == PAD).any()  # some row did stop early
    for row, committed in enumerate(out.stats.committed):
        generated = out.sequences[row, ids.shape[1]:].tolist()
        stop = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        assert committed == stop


def test_max_length_and_repetition_penalty():
    model = tiny_peft("qwen2", strength=0.6)
    ids, mask = prompts(LENGTHS)
    # The repetition penalty reads input_ids: it runs on each row's exact context.
    kw = dict(max_length=ids.shape[1] + 9, repetition_penalty=1.5)
    assert torch.equal(invisible(model, ids, mask, ROWS, num_draft_tokens=4, **kw), standard(model, ids, mask, ROWS, **kw))


def test_min_new_tokens_keeps_eos_away():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    free = standard(model, ids, mask, ROWS, max_new_tokens=8)
    kw = dict(max_new_tokens=8, min_new_tokens=5, eos_token_id=int(free[1, ids.shape[1] + 1]))
    assert torch.equal(invisible(model, ids, mask, ROWS, **kw), standard(model, ids, mask, ROWS, **kw))


class StopAfter(StoppingCriteria):
    """Stops a row once it has produced ``token``."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    free = standard(model, ids, mask, ROWS, max_new_tokens=12)
    crit = StoppingCriteriaList([StopAfter(int(free[2, ids.shape[1] + 4]))])
    ref = standard(model, ids, mask, ROWS, max_new_tokens=12, stopping_criteria=crit)
    out = invisible(model, ids, mask, ROWS, max_new_tokens=12, stopping_criteria=crit, num_draft_tokens=4)
    assert torch.equal(out, ref)


class _SeesCollector(StoppingCriteria):
    """Records whether Python's cyclic collector runs during the call; fails at ``fail_at`` calls."""

    def __init__(self, fail_at=None):
        self.seen, self.fail_at = [], fail_at

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(gc.isenabled())
        if len(self.seen) == self.fail_at:
            raise RuntimeError("a criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_call_holds_off_the_collector_and_gives_it_back(enabled):
    """The cyclic collector is off while a call runs (api._no_collection) and as the caller had it
    after, also after a call that failed; the output is stock's."""
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = standard(model, ids, mask, ROWS, max_new_tokens=6)
    (gc.enable if enabled else gc.disable)()
    try:
        seen = _SeesCollector()
        out = invisible(model, ids, mask, ROWS, max_new_tokens=6, stopping_criteria=StoppingCriteriaList([seen]))
        assert torch.equal(out, ref) and seen.seen and not any(seen.seen) and gc.isenabled() == enabled
        failing = _SeesCollector(fail_at=2)
        with pytest.raises(RuntimeError, match="a criterion failed"):
            invisible(model, ids, mask, ROWS, max_new_tokens=6, stopping_criteria=StoppingCriteriaList([failing]))
        assert gc.isenabled() == enabled
    finally:
        gc.enable()


def test_num_return_sequences_expands_adapters():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts([4, 6])
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=["s", "__base__"], do_sample=True,
                         num_return_sequences=3, max_new_tokens=5, invisible_lora=True, return_dict_in_generate=True)
    assert out.sequences.shape[0] == 6
    assert out.stats.adapter_names == ["s"] * 3 + ["__base__"] * 3


def test_statistics_add_up():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    out = invisible(model, ids, mask, ROWS, max_new_tokens=11, num_draft_tokens=3, return_dict_in_generate=True)
    s = out.stats
    assert s is state_of(model).stats
    assert all(0 <= a <= d for a, d in zip(s.accepted, s.drafted))
    assert s.committed == [11] * len(ROWS)  # no EOS here: every row got its max_new_tokens
    assert len(s.k_per_cycle) == len(s.drafter_per_cycle) == s.cycles
    assert all((k == 0) == (d is None) for k, d in zip(s.k_per_cycle, s.drafter_per_cycle))
    assert s.draft_passes == sum(k for k, d in zip(s.k_per_cycle, s.drafter_per_cycle) if d not in (None, "/lookup"))
    # per cycle a row commits its accepted drafts + 1 target token (the first comes from the prefill),
    # cut at max_new_tokens
    for c, a, n in zip(s.committed, s.accepted, s.row_cycles):
        assert n + 1 <= c <= 1 + n + a and n <= s.cycles
    assert max(s.row_cycles) == s.cycles
    per = s.per_adapter
    assert per["s"]["rows"] == 2 and per["s"]["drafted"] == s.drafted[0] + s.drafted[5]
    exact = invisible(model, ids, mask, ROWS, max_new_tokens=11, num_draft_tokens=3, gate="always", draft_dtype=None,
                      prompt_lookup=False, return_dict_in_generate=True).stats
    assert exact.per_adapter["__base__"]["acceptance"] == 1.0  # the base model as it is drafts for itself
    assert abs(s.acceptance_rate - sum(s.accepted) / sum(s.drafted)) < 1e-12


def test_no_drafts_is_not_zero_acceptance():
    """Without drafting there is no acceptance rate: "n/a (nothing drafted)", not 0% (which reads as every draft rejected)."""
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    s = invisible(model, ids, mask, ROWS, max_new_tokens=5, gate="never", return_dict_in_generate=True).stats
    assert sum(s.drafted) == 0 and s.acceptance_rate is None
    assert all(v["acceptance"] is None for v in s.per_adapter.values())
    assert "acceptance n/a (nothing drafted)" in s.summary() and "0.0%" not in s.summary()


def test_plain_tensor_return_and_explicit_function():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts([3, 5])
    out = hf_invisiblelora.generate(model, ids, attention_mask=mask, adapter_names=["b", "c"], do_sample=False,
                                    max_new_tokens=6)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, standard(model, ids, mask, ["b", "c"], max_new_tokens=6))
    assert state_of(model).stats.cycles > 0


def test_default_adapter_is_the_active_one():
    model = tiny_peft("llama", strength=0.6)
    model.set_adapter("c")
    ids, mask = prompts([3, 5])
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, invisible_lora=True)
    assert torch.equal(out, ref)
    assert state_of(model).stats.adapter_names == ["c", "c"]


def test_adapters_loaded_from_disk(tmp_path):
    from peft import PeftModel

    model = tiny_peft("llama", strength=0.6, seed=3)
    model.save_pretrained(tmp_path)  # PEFT saves each non-"default" adapter in a subfolder of its name
    ids, mask = prompts([4, 7, 2])
    names = ["s", "d", "__base__"]
    ref = standard(model, ids, mask, names, max_new_tokens=8)

    torch.manual_seed(3)  # the same base weights as tiny_peft(seed=3)
    base = ARCHS["llama"](64).double().eval()
    loaded = PeftModel.from_pretrained(base, tmp_path / "s", adapter_name="s")
    loaded.load_adapter(tmp_path / "d", adapter_name="d")
    loaded.eval()
    assert torch.equal(invisible(loaded, ids, mask, names, max_new_tokens=8, num_draft_tokens=2), ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_peft_backend_identical(arch):
    """The reference LoRA path (PEFT's per-adapter loop) decodes the same as the bank's kernels."""
    model = tiny_peft(arch, strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = standard(model, ids, mask, ROWS, max_new_tokens=10)
    assert torch.equal(invisible(model, ids, mask, ROWS, max_new_tokens=10, lora_backend="peft"), ref)


def test_adapters_added_deleted_and_rescaled_between_calls():
    from peft import LoraConfig

    from tiny import ADAPTERS

    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    ids, mask = prompts([4, 6, 5])
    invisible(model, ids, mask, ["s", "b", "s"], max_new_tokens=4)  # builds the bank
    model.add_adapter("d", LoraConfig(init_lora_weights=False, **ADAPTERS["d"]))
    model.delete_adapter("b")
    for layer in model.modules():
        if hasattr(layer, "set_scale") and "s" in getattr(layer, "scaling", {}):
            layer.set_scale("s", 3.0)
    model.eval()
    names = ["d", "s", "__base__"]
    assert torch.equal(invisible(model, ids, mask, names, max_new_tokens=8), standard(model, ids, mask, names, max_new_tokens=8))
    with pytest.raises(ValueError, match="Unknown adapter"):
        invisible(model, ids, mask, ["b", "s", "s"], max_new_tokens=4)
