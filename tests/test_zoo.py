"""The zoo recipe's pieces on tiny inputs: text cleaning, splitting, chunking, manifest, and a
three-step build on a tiny random model (no network, no real corpora); the zoo's errors and its
boundary with the decoding core."""

import ast
import dataclasses
import importlib.util
import json
import logging
import random
from pathlib import Path

import pytest
import torch

import hf_invisiblelora  # noqa: F401  (generate(invisible_lora=True))
from hf_invisiblelora import zoo
from hf_invisiblelora.zoo import corpora
from hf_invisiblelora.zoo.__main__ import main as zoo_main
from hf_invisiblelora.decode.stats import DecodingStats
from hf_invisiblelora.zoo.demo import drafting_note as demo_drafting_note
from hf_invisiblelora.zoo.demo import main as demo_main


def test_normalize_collapses_blank_lines_and_trailing_space():
    assert corpora.normalize("a  \r\nb\r\n\n\n\n\tc \n") == "a\nb\n\n\tc"


def test_brown_detag_strips_tags_and_restores_prose():
    raw = "\n\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ,/, (/( it/pps )/) ./.\n\n\n\tNext/ap one/cd ./.\n"
    assert corpora.brown_detag(raw) == 'The jury said " no ", (it).\n\nNext one.'


def test_gutenberg_body_drops_the_title_line_only():
    raw = "[Emma by Jane Austen 1816]\n\nVOLUME I\n\nCHAPTER I [1]\n"
    assert corpora.gutenberg_body(raw) == "VOLUME I\n\nCHAPTER I [1]"


def test_split_fortunes_and_overstrikes():
    raw = "First quip.\n%\nSecond\n\t-- Author\n%\nB\bBo\bol\bld\bd\n%\n"
    assert corpora.split_fortunes(raw) == ["First quip.", "Second\n\t-- Author", "Bold"]


def test_email_text_keeps_subject_and_body_without_headers():
    raw = "From: a@b.c\r\nSubject: Re: lunch\r\nReceived: by x\r\n\r\nSee you at noon.\r\n\r\n-- \r\nA\r\n"
    assert corpora.email_text(raw) == "Subject: Re: lunch\n\nSee you at noon.\n\n--\nA"
    assert corpora.email_text("From: a\n\nbody") == "body"


def test_split_heldout_is_seeded_disjoint_and_cut_on_lines():
    docs = [f"doc {i} line {j}" for i in range(50) for j in range(1)]
    train, held = corpora.split_heldout(docs, seed=3)
    assert (train, held) == corpora.split_heldout(docs, seed=3)
    assert corpora.split_heldout(docs, seed=4) != (train, held)
    train_lines, held_lines = set(train.splitlines()), set(held.splitlines())
    assert not (train_lines & held_lines - {""})
    assert (train_lines | held_lines) - {""} == set(docs)
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.15
    with pytest.raises(ValueError):
        corpora.split_heldout(["   "], seed=0)


def test_split_heldout_caps_the_text():
    train, held = corpora.split_heldout(["x" * 50 + "\n"] * 100, seed=0, max_chars=1000)
    assert len(train) + len(held) <= 1000


def test_eval_and_sample_blocks():
    ids = list(range(100))
    assert corpora.eval_blocks(ids, 32, 10) == [ids[0:32], ids[32:64], ids[64:96]]
    assert corpora.eval_blocks(ids, 32, 2) == [ids[0:32], ids[32:64]]
    batch = corpora.sample_blocks(ids, 16, 5, random.Random(0))
    assert batch == corpora.sample_blocks(ids, 16, 5, random.Random(0))
    assert all(len(b) == 16 and b == ids[b[0] : b[0] + 16] for b in batch)
    with pytest.raises(ValueError):
        corpora.sample_blocks(ids[:8], 16, 1, random.Random(0))


def test_recipes_vary_like_public_adapters():
    smol = zoo.ZOOS["smollm2"].values()
    assert len(zoo.ZOOS["smollm2"]) >= 12 and len(zoo.ZOOS["gemma3"]) >= 4
    # One adapter per domain, named after it; variants of a kind (DoRA, ...) named "<domain>_<kind>".
    assert {r.domain for r in smol} == {n for n, r in zoo.ZOOS["smollm2"].items() if n == r.domain}
    assert all(n == r.domain or n.startswith(r.domain + "_") for n, r in zoo.ZOOS["smollm2"].items())
    assert all(r.domain in corpora.DOMAINS for z in zoo.ZOOS.values() for r in z.values())
    # PEFT stores adapters in ModuleDicts: a name like "children" clashes with nn.Module attributes.
    assert not [n for z in zoo.ZOOS.values() for n in z if hasattr(torch.nn.Module, n)]
    assert min(r.r for r in smol) == 4 and max(r.r for r in smol) == 64
    assert {r.targets_label for r in smol} >= {"attention", "all-linear"} and {r.rslora for r in smol} == {True, False}
    assert {r.dora for r in smol} == {True, False} and any(r.modules_to_save for r in smol)


def test_manifest_round_trip_and_table(tmp_path):
    assert zoo.read_manifest(tmp_path) == {"adapters": {}}
    entry = {"description": "Demo text", "recipe": {"r": 4, "alpha": 8, "targets": "attention", "rslora": False},
             "base_loss": 3.21, "adapter_loss": 2.5, "train_seconds": 12.3}
    manifest = {"adapters": {"demo": entry}}
    zoo.write_manifest(tmp_path / "z", manifest)
    assert zoo.read_manifest(tmp_path / "z") == manifest and not (tmp_path / "z" / "manifest.json.tmp").exists()
    assert not zoo.is_built(tmp_path / "z", "demo", manifest)  # listed, but no adapter file
    assert "| demo | Demo text | 4 | 8 | attention | False | 3.210 -> 2.500 | 12 |" in zoo.table(manifest)
    manifest["acceptance"] = {"per_adapter": {"demo": 0.75}, "drafted_accepted": {"demo": [8, 6]}}
    assert zoo.table(manifest).splitlines()[-1].endswith(" 0.75 (6/8) |")


@pytest.fixture
def tiny_world(tmp_path, monkeypatch):
    """A tiny Llama checkpoint as the 'base model' and one in-memory text domain."""
    from tiny import ARCHS, tiny_tokenizer

    tok = tiny_tokenizer()
    ARCHS["llama"](len(tok)).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    monkeypatch.setenv("HF_INVISIBLELORA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(zoo.assets, "prepare", lambda name: tmp_path / "base")
    lines = ["the quick brown fox jumps over the lazy dog", "once upon a time there was a cat"] * 100
    monkeypatch.setitem(corpora.DOMAINS, "toy", corpora.Domain("toy text", "in memory", lambda: lines))
    return {"toy": zoo.Recipe("toy", r=4, alpha=8, targets=zoo.ATTENTION, steps=15, batch=2, block=16, lr=1e-2)}


def test_build_trains_lowers_held_out_loss_and_skips_what_exists(tiny_world, caplog):
    with caplog.at_level(logging.INFO, logger="hf_invisiblelora.zoo"):
        folder = zoo.build("tiny", recipes=tiny_world)
    assert "toy: held-out loss" in caplog.text  # progress is logged, not printed
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["adapters"]["toy"]
    assert (folder / "toy" / "adapter_model.safetensors").exists()
    assert entry["adapter_loss"] < entry["base_loss"]
    assert entry["recipe"]["targets"] == "attention" and entry["train_seconds"] > 0
    stamp = (folder / "toy" / "adapter_model.safetensors").stat().st_mtime_ns
    zoo.build("tiny", recipes=tiny_world)  # nothing missing: nothing retrained
    assert (folder / "toy" / "adapter_model.safetensors").stat().st_mtime_ns == stamp

    result = zoo.measure_acceptance("tiny", prompts_per_adapter=2, prompt_tokens=8, new_tokens=6)
    assert result["batch"] == 2 and 0.0 <= result["per_adapter"]["toy"] <= 1.0
    assert zoo.read_manifest(folder)["acceptance"] == result


def test_dora_and_modules_to_save_recipes(tiny_world):
    """The zoo's other kinds train as PEFT trains them; loading defaults to the plain LoRA ones
    (stock PEFT's mixed batch is the benchmarks' reference) and acceptance is measured for all."""
    from peft.utils.other import ModulesToSaveWrapper

    toy = tiny_world["toy"]
    recipes = {"toy": toy, "toy_dora": dataclasses.replace(toy, dora=True),
               "toy_mts": dataclasses.replace(toy, modules_to_save=("lm_head",))}
    folder = zoo.build("tiny", recipes=recipes)
    manifest = zoo.read_manifest(folder)
    assert [manifest["adapters"][n]["recipe"]["targets"] for n in recipes] == \
        ["attention", "attention (DoRA)", "attention + lm_head"]
    assert zoo.built_adapters("tiny") == ["toy"] and zoo.built_adapters("tiny", plain_only=False) == list(recipes)
    model, _, names = zoo.load_zoo("tiny")
    assert names == ["toy"] and not any(isinstance(m, ModulesToSaveWrapper) for m in model.modules())
    model, _, _ = zoo.load_zoo("tiny", ["toy_dora", "toy_mts"])
    assert model.peft_config["toy_dora"].use_dora and model.peft_config["toy_mts"].modules_to_save == ["lm_head"]
    result = zoo.measure_acceptance("tiny", prompts_per_adapter=1, prompt_tokens=8, new_tokens=6)
    assert set(result["per_adapter"]) == set(recipes)


def test_an_asset_that_cannot_be_had_is_one_error_and_an_exit_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_INVISIBLELORA_HOME", str(tmp_path))
    with pytest.raises(zoo.AssetUnavailable, match=r"no recipe for adapters \['nope'\] of the smollm2 zoo"):
        zoo.build("smollm2", only=["nope"])
    with pytest.raises(zoo.AssetUnavailable, match="build them: python -m hf_invisiblelora.zoo build --model smollm2"):
        zoo.load_zoo("smollm2")
    assert zoo_main(["build", "--only", "nope"]) == 2
    assert "error: no recipe for adapters ['nope']" in capsys.readouterr().err
    assert demo_main(["--adapters", "nope"]) == 2
    assert "error: no recipe for adapters ['nope']" in capsys.readouterr().err


def test_demo_runs_the_batch_and_one_row_by_itself(tiny_world, monkeypatch, capsys):
    """The demo on a tiny zoo: the mixed batch, then its first row by itself, each with the gate's statistics per
    adapter and how often it drafted; the same text all three ways."""
    monkeypatch.setitem(zoo.recipes.ZOOS, "smollm2", tiny_world)
    args = ["--adapters", "toy", "--prompt-tokens", "8", "--max-new-tokens", "6", "--repeats", "1", "--threads", "1"]
    assert demo_main(args) == 0
    out = capsys.readouterr().out
    assert "same text: 3/3 rows" in out and "One row by itself (batch 1), [toy]" in out and "same text: 1/1 rows" in out
    assert out.count("the gate drafted in ") == 2 and out.count("toy: rows ") == 2


def test_demo_says_why_the_gate_hardly_drafted():
    stats = DecodingStats(["a", "b"], 4, cycles=10, k_per_cycle=[4, 4, 4, 4, 4, 4, 0, 0, 0, 0])
    assert demo_drafting_note(stats, 2, 4) == "the gate drafted in 6 of 10 cycles."
    stats.k_per_cycle = [0] * 9 + [2]
    note = demo_drafting_note(stats, 9, 4)
    assert note.startswith("the gate drafted in 1 of 10 cycles: it drafts where the measured cost of the passes")
    assert "here (9 rows) a draft pass and a verify pass up to 4 tokens wider per row" in note


FORBIDDEN_IN_CORE = ("tqdm", "gguf", "hf_invisiblelora.zoo")


def test_the_core_imports_neither_the_zoo_nor_its_requirements():
    """The zoo is an extra: no module of the decoding core (or its kernels) imports it, tqdm or gguf.
    The server may, for its --zoo option only: inside the function that serves it, not on import."""
    import hf_invisiblelora.kernels
    import hf_invisiblelora.serving
    from hf_invisiblelora.serving import cli

    found = []
    for package in (hf_invisiblelora, hf_invisiblelora.kernels, hf_invisiblelora.serving):
        for path in sorted(p for folder in package.__path__ for p in Path(folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            for node in tree.body if path == Path(cli.__file__) else ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    module = importlib.util.resolve_name("." * node.level + (node.module or ""), package.__name__)
                    names = [module] + [f"{module}.{alias.name}" for alias in node.names]
                else:
                    continue
                found += [f"{path.name}: {name}" for name in names
                          if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_CORE)]
    assert not found
