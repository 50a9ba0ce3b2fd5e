"""Reloading an adapter in place while serving (Engine.load_adapter(inplace=True), vLLM's
load_inplace): a request finishes on the revision it was admitted with, the ones admitted after
decode with the new weights (each equal to standalone generate() under its revision, float64,
greedy), the old revision is deleted once its last request is done, a failed reload changes
nothing, and the prefix cache never gives one revision's blocks to another."""

import time

import pytest
import torch

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.engine import Engine, Request
from hf_invisiblelora.engine.adapters import AdapterUnsupported
from hf_invisiblelora.engine.request import Status
from hf_invisiblelora.lora.files import Unreadable
from tiny import tiny_peft


@pytest.fixture(scope="module")
def revisions(tmp_path_factory):
    """Three revisions of one adapter (other seeds, other ranks), saved: [folder]."""
    root = tmp_path_factory.mktemp("revisions")
    folders = []
    for i, config in enumerate([dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                                dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
                                dict(r=2, lora_alpha=4, target_modules=["o_proj"])]):
        tiny_peft("llama", adapters={"x": config}, strength=0.8, seed=10 + i).save_pretrained(root / str(i))
        folders.append(str(root / str(i) / "x"))
    return folders


@pytest.fixture(scope="module")
def reference(revisions):
    """The same base model with each revision loaded under its own name: x0, x1, x2."""
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    for i, folder in enumerate(revisions):
        model.load_adapter(folder, adapter_name=f"x{i}")
    return model


def standalone(model, prompt, adapter, max_tokens):
    out = model.generate(input_ids=torch.tensor([prompt]), adapter_names=[adapter], max_new_tokens=max_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def internal_names(model):
    return [a for a in model.peft_config if "#" in a]


def wait_for(condition, seconds=30):
    end = time.time() + seconds
    while not condition():
        assert time.time() < end, "timed out"
        time.sleep(0.005)


def test_requests_finish_on_the_revision_they_started_with(revisions, reference):
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 64, (40,), generator=g).tolist()
    engine = Engine(model, max_batch=3, max_len=128, num_draft_tokens=2).start()
    try:
        engine.load_adapter("x", revisions[0])
        first = engine.submit(Request(prompt, adapter="x", max_tokens=60, temperature=0, ignore_eos=True))
        wait_for(lambda: first.status == Status.DECODING)
        engine.load_adapter("x", revisions[1], inplace=True)  # while `first` decodes
        # Beside the old revision under a key of its own: nothing in PEFT is renamed or reordered
        assert list(model.peft_config) == ["s", "b", "x", "x#1"] and first.status == Status.DECODING
        second = engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0))
        assert second.result(60) == standalone(reference, prompt, "x1", 8)
        assert engine.metrics_snapshot()["prefix_hits"] == 0  # the first revision's blocks are not the second's
        base = engine.submit(Request(prompt, adapter="s", max_tokens=8, temperature=0)).result(60)
        assert first.result(60) == standalone(reference, prompt, "x0", 60)
        assert (first.revision, second.revision) == (0, 1)
        wait_for(lambda: "x" not in model.peft_config)  # the old revision deleted once its request ended
        engine.load_adapter("x", revisions[2], inplace=True)  # nothing in flight: replaced at once
        assert list(model.peft_config) == ["s", "b", "x"]  # under its name again, which was free
        third = engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0))
        assert third.result(60) == standalone(reference, prompt, "x2", 8) and third.revision == 2
        again = engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0))
        assert again.result(60) == third.result(60)
        assert engine.metrics_snapshot()["prefix_hits"] > 0  # the same revision's blocks are found
    finally:
        engine.stop()
    assert base == standalone(reference, prompt, "s", 8)
    assert sorted(model.peft_config) == ["b", "s", "x"]


def test_a_failed_reload_changes_nothing(revisions, reference, tmp_path):
    """A folder that is not an adapter for this model, or holds weights that are not finite: refused;
    the adapter serves its revision as before, under its name, with nothing left behind."""
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    other = tiny_peft("llama", adapters={"x": dict(r=4, lora_alpha=8, target_modules=["q_proj"])}, strength=0.6, seed=3)
    with torch.no_grad():
        other.base_model.model.model.layers[0].self_attn.q_proj.lora_B["x"].weight[0, 0] = float("nan")
    other.save_pretrained(tmp_path / "nan")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    prompt = [5, 6, 7, 8, 9]
    engine = Engine(model, max_batch=2, max_len=64, num_draft_tokens=2).start()
    try:
        engine.load_adapter("x", revisions[0])
        busy = engine.submit(Request(prompt, adapter="x", max_tokens=40, temperature=0, ignore_eos=True))
        wait_for(lambda: busy.status == Status.DECODING)
        for folder, error in ((tmp_path / "nan" / "x", AdapterUnsupported), (tmp_path / "empty", Unreadable)):
            with pytest.raises(error):
                engine.load_adapter("x", str(folder), inplace=True)
            assert not internal_names(model) and "x" in model.peft_config
        after = engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0)).result(60)
        assert busy.result(60) == standalone(reference, prompt, "x0", 40)
    finally:
        engine.stop()
    assert after == standalone(reference, prompt, "x0", 8)
    assert sorted(model.peft_config) == ["b", "s", "x"]


def test_without_inplace_a_served_name_is_refused(revisions):
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    engine = Engine(model, max_batch=2, max_len=64).start()
    try:
        engine.load_adapter("x", revisions[0])
        with pytest.raises(ValueError, match="already served"):
            engine.load_adapter("x", revisions[1])
        engine.load_adapter("y", revisions[1], inplace=True)  # a new name: a plain load
        assert {"x", "y"} <= set(engine.adapters()) and "y" in model.peft_config
    finally:
        engine.stop()


def test_stopping_mid_request_leaves_no_old_revision(revisions):
    """A request still decoding on an old revision when the engine stops is cancelled; the model keeps
    one adapter per name served, the old revision deleted."""
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    engine = Engine(model, max_batch=2, max_len=128, num_draft_tokens=2).start()
    try:
        engine.load_adapter("x", revisions[0])
        busy = engine.submit(Request(list(range(3, 20)), adapter="x", max_tokens=100, temperature=0, ignore_eos=True))
        wait_for(lambda: busy.status == Status.DECODING)
        engine.load_adapter("x", revisions[1], inplace=True)
        assert internal_names(model) == ["x#1"]
    finally:
        engine.stop()
    assert busy.finish_reason == "cancelled" and list(model.peft_config) == ["s", "b", "x#1"]


def test_a_checkpoint_of_the_same_shape_is_written_in_place(tmp_path):
    """A training loop's next checkpoint (the same config, new weights), with no request on the old
    revision: the new weights go into the adapter's own tensors (no module built), the answers are
    the new revision's, and one with weights that are not finite leaves the old ones."""
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True)
    folders = []
    for seed in (20, 21):
        tiny_peft("llama", adapters={"x": config}, strength=0.8, seed=seed).save_pretrained(tmp_path / str(seed))
        folders.append(str(tmp_path / str(seed) / "x"))
    bad = tiny_peft("llama", adapters={"x": config}, strength=0.8, seed=22)
    with torch.no_grad():
        bad.base_model.model.model.layers[1].mlp.down_proj.lora_B["x"].weight[0, 0] = float("inf")
    bad.save_pretrained(tmp_path / "bad")
    reference = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    for i, folder in enumerate(folders):
        reference.load_adapter(folder, adapter_name=f"x{i}")
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    prompt = [5, 9, 2, 7, 11, 3]

    def alone(adapter):  # stock PEFT takes no adapter_names with DoRA: the adapter set active
        reference.set_adapter(adapter)
        out = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        return out[0, len(prompt):].tolist()

    engine = Engine(model, max_batch=2, max_len=64, num_draft_tokens=2).start()
    try:
        engine.load_adapter("x", folders[0])
        layer = model.base_model.model.model.layers[1].mlp.down_proj
        module, magnitude = layer.lora_A["x"], layer.lora_magnitude_vector["x"]
        first = engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0)).result(60)
        engine.load_adapter("x", folders[1], inplace=True)
        assert layer.lora_A["x"] is module and layer.lora_magnitude_vector["x"] is magnitude  # written in place
        second = engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0))
        assert second.result(60) == alone("x1") and second.revision == 1
        with pytest.raises(AdapterUnsupported):
            engine.load_adapter("x", str(tmp_path / "bad" / "x"), inplace=True)
        again = engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0))
        assert again.result(60) == second.result(60) and again.revision == 1
        engine.load_adapter("x", folders[0], inplace=True)  # back to the first weights: the first answer
        assert engine.submit(Request(prompt, adapter="x", max_tokens=8, temperature=0)).result(60) == first
    finally:
        engine.stop()
    assert first == alone("x0")
    assert sorted(model.peft_config) == ["b", "s", "x"] and layer.lora_A["x"] is module
