"""Choices made by measurement (tuning.py): a verdict measured once per machine and key, kept on disk for
the next process, not kept when the machine was busy while it was measured; a candidate replaces the
reference only where it is faster by the margin; the real measurements of prepack="auto" and
draft_dtype="auto" on a model give verdicts of their form, and the choices follow them."""

import json
import subprocess
import sys

import pytest
import torch

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora import tuning
from hf_invisiblelora.decode import low_precision
from hf_invisiblelora.kernels import packed_linear
from hf_invisiblelora.model import prepack
from hf_invisiblelora.model.walk import linears
from tiny import tiny_peft


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_INVISIBLELORA_HOME", str(tmp_path))
    monkeypatch.delenv("HF_INVISIBLELORA_TUNING", raising=False)
    monkeypatch.setattr(tuning, "busy_cpus", lambda: 0.0)
    tuning.clear()
    yield tmp_path
    tuning.clear()


def test_a_verdict_is_measured_once_and_kept_for_the_next_process(home):
    runs = []

    def measure():
        runs.append(1)
        return {"fewest": 4}
    assert tuning.tuned("kind", [[3, 2]], measure) == {"fewest": 4}
    assert tuning.tuned("kind", [[3, 2]], measure) == {"fewest": 4} and len(runs) == 1
    tuning.clear()  # a new process: read from the machine's file
    assert tuning.tuned("kind", [[3, 2]], measure) == {"fewest": 4} and len(runs) == 1
    [path] = (home / "tuning").iterdir()
    saved = json.loads(path.read_text())
    assert saved["machine"] == tuning.machine() and list(saved["verdicts"].values()) == [{"fewest": 4}]
    assert tuning.tuned("kind", [[3, 3]], measure) == {"fewest": 4} and len(runs) == 2  # another key
    code = (f"import json, torch; torch.set_num_threads({torch.get_num_threads()}); "  # the same machine key
            "from hf_invisiblelora import tuning; "
            "print(json.dumps(tuning.tuned('kind', [[3, 2]], lambda: {'fewest': -1})))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_INVISIBLELORA_HOME": str(home)})
    assert json.loads(out.stdout.splitlines()[-1]) == {"fewest": 4}, out.stderr[-2000:]


def test_a_verdict_measured_while_busy_is_not_kept(home, monkeypatch):
    monkeypatch.setattr(tuning, "busy_cpus", lambda: 1.0)
    assert tuning.tuned("kind", "k", lambda: {"v": 1}) == {"v": 1}
    assert not (home / "tuning").exists()
    tuning.clear()
    monkeypatch.setattr(tuning, "busy_cpus", lambda: 0.0)
    assert tuning.tuned("kind", "k", lambda: {"v": 2}) == {"v": 2}  # measured again, now kept
    assert (home / "tuning").exists()


def test_off_keeps_nothing_on_disk(home, monkeypatch):
    monkeypatch.setenv("HF_INVISIBLELORA_TUNING", "off")
    assert tuning.tuned("kind", "k", lambda: {"v": 1}) == {"v": 1}
    assert not (home / "tuning").exists()


def test_pick_keeps_the_reference_unless_clearly_faster():
    assert tuning.pick({"plain": 1.0, "packed": 0.95}, "plain") == "plain"  # within the margin: a noisy tie
    assert tuning.pick({"plain": 1.0, "packed": 0.8}, "plain") == "packed"
    assert tuning.pick({"plain": 1.0, "packed": 1.3}, "plain") == "plain"
    times = tuning.fastest({"a": lambda: None, "b": lambda: sum(range(20000))}, repeats=3)
    assert set(times) == {"a", "b"} and times["a"] < times["b"]


def test_the_real_measurements_give_verdicts_of_their_form(home):
    model = tiny_peft("llama", strength=0.6, dtype=torch.float32)
    modules = [m for m in linears(model) if prepack._eligible(m)]
    chosen = prepack.choices(modules)
    assert set(chosen) == {prepack._shape(m) for m in modules}
    formats = packed_linear.formats(torch.float32, torch.device("cpu"))
    assert all(fmt in formats and counts and set(counts) <= set(prepack.TOKENS) or (fmt, counts) == (None, [])
               for fmt, counts in chosen.values())
    dtypes = low_precision.auto_dtypes(model)
    assert dtypes[0] is None and set(dtypes[1:]) <= set(low_precision.AUTO) and len(dtypes) <= 1 + low_precision.AUTO_KEEP
    [path] = (home / "tuning").iterdir()
    kinds = {name.split(":")[0] for name in json.loads(path.read_text())["verdicts"]}
    assert kinds == {"prepack_format", "draft_dtype"}


def test_draft_dtypes_follow_the_verdict(home, monkeypatch):
    monkeypatch.setenv("HF_INVISIBLELORA_TUNING", "off")
    model = tiny_peft("llama", strength=0.6, dtype=torch.float32)
    monkeypatch.setattr(low_precision, "_faster_dtypes", lambda groups: {"faster": ["int4", "bfloat16"]})
    assert low_precision.auto_dtypes(model) == (None, torch.int4, torch.bfloat16)
    tuning.clear()
    monkeypatch.setattr(low_precision, "_faster_dtypes", lambda groups: {"faster": []})
    assert low_precision.auto_dtypes(model) == (None,)


def test_the_lora_path_is_timed_once_and_decodes_as_stock_either_way(home, monkeypatch):
    """Several active adapters on the torch path: which of its paths (packed, gathered, runs) computes a
    pass is measured (lora/layer.py's torch_path), once per set of ranks, token count and run count
    (rounded up to powers of two), kept for the next process; every verdict decodes as stock."""
    from hf_invisiblelora.lora import layer as lora_layer

    model = tiny_peft("llama", strength=0.6)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 64, (4, 9), generator=g)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=["s", "b", "c", "s"],
              do_sample=False, max_new_tokens=6, pad_token_id=0)
    stock = model.generate(**kw)
    timed = []
    for verdict in lora_layer.PATHS:
        tuning.clear()
        for path in (home / "tuning").glob("*.json"):
            path.unlink()

        def measure(bank, sample, slots, tokens, runs, verdict=verdict):
            timed.append((slots, tokens, runs))
            return {"path": verdict, "ms": {}}
        monkeypatch.setattr(lora_layer, "_time_paths", measure)
        before = len(timed)
        assert model.generate(**kw, invisible_lora=True, gate="never").tolist() == stock.tolist()
        # The prefill's 36 tokens and the steps' 4 (the head sees as many), over slots s, b, c, in 4 runs (the rows).
        assert sorted(t for _, t, _ in timed[before:]) == [4, 64]
        assert all(len(s) == 3 and runs == 4 for s, _, runs in timed[before:])
        assert model.generate(**kw, invisible_lora=True, gate="never").tolist() == stock.tolist()
        assert len(timed) == before + 2  # the verdicts kept
    [path] = (home / "tuning").iterdir()
    saved = json.loads(path.read_text())["verdicts"]
    assert sorted(v["path"] for k, v in saved.items() if k.startswith("lora_path:")) == ["runs", "runs"]


def test_the_lora_path_measurement_times_every_path(home):
    from hf_invisiblelora.lora import layer as lora_layer
    from hf_invisiblelora.lora.bank import get_bank

    model = tiny_peft("llama", strength=0.6, dtype=torch.float32)
    bank = get_bank(model, adapters=("s", "b", "c"))
    sample = list(bank.layers.values())[: lora_layer.SAMPLE_LAYERS]
    verdict = lora_layer._time_paths(bank, sample, (0, 1, 2), 64, 4)
    assert verdict["path"] in lora_layer.PATHS and set(verdict["ms"]) == set(lora_layer.PATHS)
    assert all(v > 0 for v in verdict["ms"].values())


def test_measurements_inside_a_seeded_call_leave_its_random_stream(home):
    """The first call on a machine measures its choices (the LoRA path, prepacking, the drafters'
    dtypes) while it decodes: their timing inputs come from generators of their own, so a seeded
    call samples what the same call samples once the verdicts are kept."""
    model = tiny_peft("llama", strength=0.6, dtype=torch.float32)
    ids = torch.randint(2, 64, (4, 9), generator=torch.Generator().manual_seed(5))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=["s", "b", "c", "s"],
              do_sample=True, max_new_tokens=8, pad_token_id=0, invisible_lora=True, gate="always",
              num_draft_tokens=2)  # a fixed k: the "auto" gate's follows the timings of the call's passes
    torch.manual_seed(11)
    first = model.generate(**kw)
    [path] = (home / "tuning").iterdir()
    kinds = {k.split(":")[0] for k in json.loads(path.read_text())["verdicts"]}
    assert {"lora_path", "prepack_format"} <= kinds, kinds  # measured during the first call
    torch.manual_seed(11)
    assert torch.equal(model.generate(**kw), first)
