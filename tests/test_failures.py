"""Every engine command made to fail at every step it takes changes nothing for any tenant.

The commands: load a new name, reload in place (beside the old revision while rows hold it, or
written into its tensors when none does), unload, resolve, evict (and load an evicted adapter again).
The failures: a folder that is missing, a FIFO or a folder where the weights file should be, weights
made for another model or not finite, and exceptions raised inside PEFT's injection, inside the
weights' loading, by the servable check, out of memory, and by a deletion. Each runs with other
adapters' requests in flight (float64, greedy); afterwards the model's adapters (their order, modules,
parameters and values), the engine's records and every tenant's answers are as before: the requests
in flight and the ones after each equal stock generate() under the weights they were admitted with.
A command that fails is refused with an error naming what is wrong, and the same command with a good
folder then succeeds (nothing was left half-done).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from multiprocessing.pool import ThreadPool

import pytest
import torch
from peft import PeftModel

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.engine import AdapterBusy, AdapterUnsupported, Engine, Request, UnknownAdapter, adapters
from hf_invisiblelora.engine.request import Status
from hf_invisiblelora.lora import peft_ops
from hf_invisiblelora.lora.files import Unreadable
from test_serve import files, generate, launch, reference, request  # noqa: F401  (fixtures)
from tiny import tiny_peft

SERVED = ("s", "b", "c")
PROMPT = [5, 9, 2, 7, 11, 3, 8]
X = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Saved adapters: x0 and x1 (one layout, other weights), x2 (another layout), other (made for a model
    with another vocabulary), nan (weights not finite)."""
    root = tmp_path_factory.mktemp("failures")
    made = {"x0": (X, 10, 64), "x1": (X, 11, 64), "x2": (dict(r=2, lora_alpha=4, target_modules=["o_proj"]), 12, 64),
            "other": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]), 13, 80), "nan": (X, 14, 64)}
    out = {}
    for name, (config, seed, vocab) in made.items():
        model = tiny_peft("llama", vocab=vocab, adapters={"x": config}, strength=0.8, seed=seed)
        if name == "nan":
            with torch.no_grad():
                model.base_model.model.model.layers[0].mlp.down_proj.lora_B["x"].weight[0, 0] = float("nan")
        model.save_pretrained(root / name)
        out[name] = str(root / name / "x")
    return out


@pytest.fixture(scope="module")
def stock(folders):
    """The served model's adapters and each revision of x under its own name: stock's answers (every
    request here ignores EOS, runs to its budget)."""
    model = tiny_peft("llama", adapters=SERVED, strength=0.6)
    model.generation_config.eos_token_id = None
    for name in ("x0", "x1", "x2"):
        model.load_adapter(folders[name], adapter_name=name)
    answers = {}

    def answer(adapter, max_tokens):
        if (adapter, max_tokens) not in answers:
            out = model.generate(input_ids=torch.tensor([PROMPT]), adapter_names=[adapter], max_new_tokens=max_tokens,
                                 do_sample=False)
            answers[adapter, max_tokens] = out[0, len(PROMPT):].tolist()
        return answers[adapter, max_tokens]
    return answer


def bad_folder(folders, folder, kind: str) -> str:
    """``folder`` made a folder that a load refuses while reading it or loading it into the model (or
    left missing)."""
    if kind != "missing":
        shutil.copytree(folders[kind if kind in ("other", "nan") else "x1"], folder)
    if kind in ("fifo", "folder"):
        weights = folder / "adapter_model.safetensors"
        weights.unlink()
        if kind == "fifo":
            os.mkfifo(weights)
        else:  # a folder where the weights file should be
            weights.mkdir()
    return str(folder)


FOLDER_FAILURES = {"missing": Unreadable, "fifo": Unreadable, "folder": Unreadable, "other": Unreadable,
                   "nan": AdapterUnsupported}


def raising_after(target, name: str, error: BaseException, times: int = 1):
    """``target.name`` that runs and then raises ``error`` (its first ``times`` calls): a failure after
    its work is half done."""
    original, calls = getattr(target, name), [0]

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] <= times:
            raise error
        return result
    return original, wrapper


STEP_FAILURES = {  # step -> (where to patch, attribute, error raised, the error the command raises)
    "injection": (PeftModel, "add_adapter", RuntimeError("injected in PEFT's injection"), Unreadable),
    "weights": (peft_ops, "set_peft_model_state_dict", RuntimeError("injected in the weights' loading"), Unreadable),
    "check": (adapters, "check_model", ValueError("injected in the servable check"), AdapterUnsupported),
    "memory": (peft_ops, "set_peft_model_state_dict", MemoryError("injected"), MemoryError),
}


def state(model, engine):
    """What a failed command must leave as it was: the model's adapters in order, every module and
    parameter by identity with its values, and the engine's records."""
    return (list(model.peft_config), [(n, id(m)) for n, m in model.named_modules()],
            [(n, id(p), p.detach().clone()) for n, p in model.named_parameters()],
            engine.adapters(), engine.adapter_paths(), engine.metrics_snapshot()["loaded_adapters"])


def same(a, b) -> bool:
    return a[:2] == b[:2] and a[3:] == b[3:] and len(a[2]) == len(b[2]) and \
        all(n == m and i == j and torch.equal(p, q) for (n, i, p), (m, j, q) in zip(a[2], b[2]))


def wait_for(condition, seconds=30):
    end = time.time() + seconds
    while not condition():
        assert time.time() < end, "timed out"
        time.sleep(0.002)


def in_flight(engine, names, max_tokens=90):
    """Requests under ``names`` decoding when this returns."""
    handles = {a: engine.submit(Request(PROMPT, adapter=a, max_tokens=max_tokens, temperature=0, ignore_eos=True))
               for a in names}
    wait_for(lambda: all(h.status == Status.DECODING for h in handles.values()))
    return handles


def answers(engine, names, max_tokens=8):
    return {a: engine.submit(Request(PROMPT, adapter=a, max_tokens=max_tokens, temperature=0, ignore_eos=True)).result(60)
            for a in names}


def fails_alone(command, error, seconds=20):
    """``command()`` raises ``error`` within ``seconds`` (never hangs: a FIFO is not waited on)."""
    box = {}

    def run():
        try:
            command()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the command hung"
    assert isinstance(box.get("error"), error), box.get("error")
    return box["error"]


def check_tenants(engine, stock, handles, x_revision):
    """Requests in flight finish as stock's under the revision they started with; new ones under every
    adapter (x at ``x_revision``) answer as stock's."""
    for a, h in handles.items():
        assert h.result(60) == stock("x0" if a == "x" else a, 90), a
    names = [*SERVED, *(["x"] if x_revision is not None else [])]
    got = answers(engine, names)
    assert got == {a: stock(x_revision if a == "x" else a, 8) for a in names}


CASES = [(cmd, kind) for cmd in ("load", "reload_held", "reload_free")
         for kind in [*FOLDER_FAILURES, *STEP_FAILURES]
         if not (cmd == "reload_free" and kind == "injection")]  # written into its tensors: no injection


@pytest.mark.parametrize("command,failure", CASES)
def test_a_failed_load_or_reload_changes_nothing(folders, stock, tmp_path, monkeypatch, command, failure):
    """load: a new name; reload_held: x reloaded in place while a row decodes with it (the new revision
    beside the old); reload_free: with no row on it and the same layout (written into its tensors)."""
    model = tiny_peft("llama", adapters=SERVED, strength=0.6)
    engine = Engine(model, max_batch=4, max_len=128, num_draft_tokens=2).start()
    try:
        if command != "load":
            engine.load_adapter("x", folders["x0"])
        handles = in_flight(engine, ["b", "x"] if command == "reload_held" else ["b"])
        before = state(model, engine)
        if failure in FOLDER_FAILURES:
            folder, error = bad_folder(folders, tmp_path / failure, failure), FOLDER_FAILURES[failure]
        else:
            target, name, raised, error = STEP_FAILURES[failure]
            folder = folders["x1"]
            monkeypatch.setattr(target, name, raising_after(target, name, raised)[1])
        name = "y" if command == "load" else "x"
        e = fails_alone(lambda: engine.load_adapter(name, folder, inplace=command != "load"), error)
        assert "injected" in str(e) or failure in FOLDER_FAILURES
        monkeypatch.undo()
        assert same(state(model, engine), before)
        check_tenants(engine, stock, handles, None if command == "load" else "x0")
        # Nothing was left half-done: the same command with a good folder succeeds.
        engine.load_adapter(name, folders["x1"], inplace=command != "load")
        assert answers(engine, [name]) == {name: stock("x1", 8)}
        assert engine.error is None
    finally:
        engine.stop()


def test_a_failed_unload_changes_nothing(folders, stock, monkeypatch):
    model = tiny_peft("llama", adapters=SERVED, strength=0.6)
    engine = Engine(model, max_batch=4, max_len=128, num_draft_tokens=2).start()
    try:
        engine.load_adapter("x", folders["x0"])
        handles = in_flight(engine, ["b", "x"])
        before = state(model, engine)
        for name, error in (("x", AdapterBusy), ("nobody", UnknownAdapter)):
            fails_alone(lambda: engine.unload_adapter(name), error)
            assert same(state(model, engine), before)
        check_tenants(engine, stock, handles, "x0")
        before = state(model, engine)
        monkeypatch.setattr(adapters, "remove_adapter", raising_before(RuntimeError("injected in the deletion")))
        fails_alone(lambda: engine.unload_adapter("c"), RuntimeError)
        monkeypatch.undo()
        assert same(state(model, engine), before)
        check_tenants(engine, stock, {}, "x0")
        engine.unload_adapter("c")
        assert "c" not in engine.adapters() and "c" not in model.peft_config
    finally:
        engine.stop()


def raising_before(error):
    def fail(*args, **kwargs):
        raise error
    return fail


def test_a_failed_eviction_or_load_again_harms_no_one(folders, stock, tmp_path, monkeypatch):
    """max_cpu_loras=4: a load past it evicts the least recently used idle adapter. An eviction that
    fails leaves the victim loaded and the load done; an evicted adapter whose folder is gone when a
    request needs it fails that request alone, and loads again once its folder is back."""
    model = tiny_peft("llama", adapters=SERVED, strength=0.6)
    folder = tmp_path / "x"
    shutil.copytree(folders["x0"], folder)
    engine = Engine(model, max_batch=4, max_len=128, num_draft_tokens=2, max_cpu_loras=4).start()
    try:
        engine.load_adapter("x", str(folder))
        handles = in_flight(engine, ["b"])
        monkeypatch.setattr(adapters, "remove_adapter", raising_before(RuntimeError("injected in the eviction")))
        engine.load_adapter("y", folders["x1"])  # past the bound; its eviction fails: the load stands
        monkeypatch.undo()
        assert {"x", "y"} <= set(model.peft_config)
        check_tenants(engine, stock, handles, "x0")
        assert answers(engine, ["y"]) == {"y": stock("x1", 8)}
        engine.load_adapter("z", folders["x2"])  # this eviction works: x, the least recently used idle one
        assert "x" not in model.peft_config and "x" in engine.adapters()
        moved = tmp_path / "away"
        folder.rename(moved)
        handles = in_flight(engine, ["b"])
        lost = engine.submit(Request(PROMPT, adapter="x", max_tokens=8, temperature=0, ignore_eos=True))
        lost.result(60)
        assert lost.finish_reason == "error" and "x" in lost.error
        check_tenants(engine, stock, handles, None)
        moved.rename(folder)
        assert answers(engine, ["x", "z"]) == {"x": stock("x0", 8), "z": stock("x2", 8)}
        assert engine.error is None
    finally:
        engine.stop()


@pytest.mark.parametrize("failure", [*FOLDER_FAILURES, "injection", "weights"])
def test_a_failed_resolution_changes_nothing(folders, stock, tmp_path, monkeypatch, failure):
    """An adapter a request names, found in a resolver folder that holds a bad one: the request is
    refused with the load's error (a 4xx over HTTP) and no one else is touched; once the folder
    holds a good adapter, the next request resolves it afresh."""
    root = tmp_path / "root"
    root.mkdir()
    model = tiny_peft("llama", adapters=SERVED, strength=0.6)
    engine = Engine(model, max_batch=4, max_len=128, num_draft_tokens=2, lora_resolver_dirs=[str(root)]).start()
    try:
        if failure in FOLDER_FAILURES:  # found as <dir>/<name>
            error = UnknownAdapter if failure == "missing" else FOLDER_FAILURES[failure]
            bad_folder(folders, root / "y", failure)
        else:
            target, name, raised, error = STEP_FAILURES[failure]
            shutil.copytree(folders["x1"], root / "y")
            monkeypatch.setattr(target, name, raising_after(target, name, raised)[1])
        handles = in_flight(engine, ["b"])
        before = state(model, engine)
        fails_alone(lambda: engine.submit(Request(PROMPT, adapter="y", max_tokens=8, temperature=0, ignore_eos=True)), error)
        monkeypatch.undo()
        assert same(state(model, engine), before)
        check_tenants(engine, stock, handles, None)
        shutil.rmtree(root / "y", ignore_errors=True)
        shutil.copytree(folders["x1"], root / "y")
        assert answers(engine, ["y"]) == {"y": stock("x1", 8)}
    finally:
        engine.stop()


def test_failed_commands_over_http(files, reference, tmp_path):  # noqa: F811
    """Over HTTP: reloads in place from folders that cannot be served are 4xx naming the field; /v1/models
    and every adapter's answers stay as they were, with a request streaming meanwhile. Unloads racing
    reloads in place leave the server's list the engine's own: each listed adapter has its folder and
    answers; a name not served can be loaded."""
    ids = [7, 8, 9, 10, 11]
    spare, other = str(files / "spare" / "d"), str(files / "adapters" / "c")
    bad = {kind: bad_folder({"x1": spare, "other": spare, "nan": spare}, tmp_path / kind, kind)
           for kind in ("missing", "fifo", "folder")}
    with launch(files, tmp_path / "server.log", "--allow-runtime-lora-updating") as (url, _):
        def complete(name, n=6):
            status, body = request(url, "/v1/completions", {"model": name, "prompt": ids, "max_tokens": n,
                                                            "temperature": 0})
            assert status == 200, body
            return body["choices"][0]["text"]

        load = {"lora_name": "swap", "lora_path": spare}
        assert request(url, "/v1/load_lora_adapter", load)[0] == 200
        expected = {name: complete(name) for name in ("s", "b", "c", "swap")}
        assert expected["swap"] == complete("swap") and expected["c"] != expected["swap"]
        listed = request(url, "/v1/models")[1]["data"]
        with ThreadPool(1) as pool:
            streaming = pool.apply_async(complete, ("b", 200))
            for kind, folder in bad.items():
                status, body = request(url, "/v1/load_lora_adapter", dict(load, lora_path=folder, load_inplace=True))
                assert status == 400 and body["error"]["param"] == "lora_path", (kind, body)
                assert request(url, "/v1/models")[1]["data"] == listed
                assert {name: complete(name) for name in expected} == expected
            streaming.get(120)
        assert all(expected[name] == generate(reference, ids, name, 6)[1] for name in ("s", "b", "c"))

        statuses = []
        for _ in range(6):  # unloads racing reloads in place
            with ThreadPool(3) as pool:
                busy = pool.apply_async(complete, ("b", 120))
                reload = pool.apply_async(request, (url, "/v1/load_lora_adapter", dict(load, lora_path=other,
                                                                                       load_inplace=True)))
                unload = pool.apply_async(request, (url, "/v1/unload_lora_adapter", {"lora_name": "swap"}))
                statuses += [reload.get(60)[0], unload.get(60)[0]]
                busy.get(120)
            models = {m["id"]: m["root"] for m in request(url, "/v1/models")[1]["data"]}
            if "swap" in models:
                assert models["swap"] in (spare, other) and complete("swap")
            else:
                assert request(url, "/v1/load_lora_adapter", load)[0] == 200
        assert all(status < 500 for status in statuses), statuses
