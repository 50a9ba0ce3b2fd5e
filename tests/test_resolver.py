"""Adapters resolved when a request first names them (Engine(lora_resolver_dirs=), serve
--lora-resolver-dir; engine/resolver.py): a plain folder per name and a Hugging Face Hub cache
(offline, its snapshot's files links into its blobs), loaded once however many requests name it at
the same time, answered as standalone generate(); a name found nowhere is unknown (404), a folder
that holds no servable adapter refused for every request naming it (400), files outside the folder
refused (403), a name that climbs out of the folder never looked up."""

import os
import shutil
import threading

import pytest
import torch
from test_serve import files, launch, reference  # noqa: F401  (fixtures)
from test_serve_security import assert_error, call

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.engine import Engine, Request, UnknownAdapter
from hf_invisiblelora.engine.adapters import AdapterUnsupported
from hf_invisiblelora.lora.files import OutsideRoots, Unreadable
from tiny import tiny_peft


def hub_cache(hub, org, repo, folder, revision="0123abcd"):
    """``folder``'s files as a Hugging Face Hub cache keeps a snapshot: blobs named by content, the
    snapshot's files links to them, refs/main naming the snapshot."""
    repo_dir = hub / f"models--{org}--{repo}"
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(folder))):
        blob = repo_dir / "blobs" / f"blob{i}"
        shutil.copy(os.path.join(folder, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A resolver folder with adapters "plain" (and "team/nested"), a Hub cache with "org/cached", a
    bad one ("nan": a weight that is not finite), a Hub snapshot whose file links outside the cache,
    and the sources: {name: folder of its files}."""
    root = tmp_path_factory.mktemp("resolve")
    sources = {}
    for i, name in enumerate(["plain", "cached", "nested"]):
        model = tiny_peft("llama", adapters={"x": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])},
                          strength=0.8, seed=20 + i)
        model.save_pretrained(root / "sources" / name)
        sources[name] = root / "sources" / name / "x"
    bad = tiny_peft("llama", adapters={"x": dict(r=4, lora_alpha=8, target_modules=["q_proj"])}, strength=0.6, seed=3)
    with torch.no_grad():
        bad.base_model.model.model.layers[0].self_attn.q_proj.lora_B["x"].weight[0, 0] = float("nan")
    bad.save_pretrained(root / "sources" / "nan")
    lookup = root / "lookup"
    shutil.copytree(sources["plain"], lookup / "plain")
    shutil.copytree(sources["nested"], lookup / "team" / "nested")
    shutil.copytree(root / "sources" / "nan" / "x", lookup / "nan")
    other = tiny_peft("llama", vocab=80, adapters={"x": dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])},
                      strength=0.6, seed=4)
    other.save_pretrained(root / "sources" / "other")  # made for a model with another vocabulary
    shutil.copytree(root / "sources" / "other" / "x", lookup / "other")
    shutil.copytree(sources["plain"], lookup / "dir")
    os.remove(lookup / "dir" / "adapter_model.safetensors")
    os.mkdir(lookup / "dir" / "adapter_model.safetensors")  # a folder where the weights file should be
    hub = root / "hub"
    hub_cache(hub, "org", "cached", sources["cached"])
    leaky = hub_cache(hub, "org", "leaky", sources["cached"])
    os.remove(leaky / "adapter_model.safetensors")
    os.symlink(sources["cached"] / "adapter_model.safetensors", leaky / "adapter_model.safetensors")  # out of the cache
    return dict(lookup=lookup, hub=hub, sources=sources)


def standalone(model, prompt, adapter, max_tokens):
    out = model.generate(input_ids=torch.tensor([prompt]), adapter_names=[adapter], max_new_tokens=max_tokens,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def test_adapters_are_found_loaded_once_and_answer_as_standalone(folders):
    served = tiny_peft("llama", adapters=("s",), strength=0.6)
    ref = tiny_peft("llama", adapters=("s",), strength=0.6)
    for name, folder in folders["sources"].items():
        ref.load_adapter(str(folder), adapter_name=name)
    prompt = [5, 6, 7, 8, 9, 10]
    engine = Engine(served, max_batch=4, max_len=64, lora_resolver_dirs=[folders["lookup"], folders["hub"]]).start()
    try:
        for name, source in (("plain", "plain"), ("org/cached", "cached"), ("team/nested", "nested")):
            handles, errors = [], []

            def submit(name=name):
                try:
                    handles.append(engine.submit(Request(prompt, adapter=name, max_tokens=6, temperature=0)))
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
            loads = engine.metrics_snapshot()["loads"]
            threads = [threading.Thread(target=submit) for _ in range(4)]  # first requests at the same time
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors and len(handles) == 4
            assert engine.metrics_snapshot()["loads"] == loads + 1  # loaded once
            expected = standalone(ref, prompt, source, 6)
            assert all(h.result(60) == expected for h in handles), name
        assert {"plain", "org/cached", "team/nested"} <= set(engine.adapters())
        for name in ("missing", "org/missing", "team/../plain", "../lookup/plain", "team//nested"):
            with pytest.raises(UnknownAdapter):
                engine.submit(Request(prompt, adapter=name, max_tokens=2))
        for name, error in (("nan", AdapterUnsupported), ("org/leaky", OutsideRoots)):
            for _ in range(2):  # every request naming it is refused; nothing stays behind
                with pytest.raises(error):
                    engine.submit(Request(prompt, adapter=name, max_tokens=2))
            assert name not in engine.adapters() and name not in served.peft_config
        assert engine.submit(Request(prompt, adapter="s", max_tokens=6, temperature=0)).result(60) == \
            standalone(ref, prompt, "s", 6)
    finally:
        engine.stop()


def test_resolved_adapters_are_evicted_and_loaded_again(folders, tmp_path):
    """With --max-cpu-loras 1, each resolved adapter evicts the last (it keeps its folder and the folder
    it was found in) and is loaded again from there when named again."""
    served = tiny_peft("llama", adapters=("s",), strength=0.6)
    ref = tiny_peft("llama", adapters=("s",), strength=0.6)
    ref.load_adapter(str(folders["sources"]["plain"]), adapter_name="plain")
    ref.load_adapter(str(folders["sources"]["cached"]), adapter_name="cached")
    prompt = [9, 8, 7, 6]
    served.save_pretrained(tmp_path)
    own = tmp_path / "s" if (tmp_path / "s").exists() else tmp_path
    engine = Engine(served, max_batch=2, max_len=64, max_cpu_loras=1, adapter_paths={"s": str(own)},
                    lora_resolver_dirs=[folders["lookup"], folders["hub"]])
    engine.start()
    try:
        for name, source in (("plain", "plain"), ("org/cached", "cached"), ("plain", "plain")):
            out = engine.submit(Request(prompt, adapter=name, max_tokens=5, temperature=0)).result(60)
            assert out == standalone(ref, prompt, source, 5)
            assert len(served.peft_config) <= 2
        assert engine.metrics_snapshot()["evictions"] >= 2
    finally:
        engine.stop()


def test_resolved_adapters_are_bounded_by_default_and_found_afresh(folders, tmp_path):
    """With no --max-cpu-loras, resolved adapters are bounded (by max_loras, else max_batch; vLLM's
    default): requests naming many resolvable copies leave at most that many loaded, the evicted ones
    forgotten. A name whose folder is removed after its eviction is then a name found nowhere (404), and
    resolved afresh once it is back."""
    lookup = tmp_path / "lookup"
    for i in range(8):
        shutil.copytree(folders["sources"]["plain"], lookup / f"copy{i}")
    served = tiny_peft("llama", adapters=("s",), strength=0.6)
    ref = tiny_peft("llama", adapters=("s",), strength=0.6)
    ref.load_adapter(str(folders["sources"]["plain"]), adapter_name="plain")
    prompt = [9, 8, 7, 6]
    expected = standalone(ref, prompt, "plain", 5)
    engine = Engine(served, max_batch=4, max_len=64, max_loras=2, lora_resolver_dirs=[lookup]).start()
    try:
        assert engine.limits.max_cpu_loras == 2
        for i in range(8):
            assert engine.submit(Request(prompt, adapter=f"copy{i}", max_tokens=5, temperature=0)).result(60) == expected
            assert len(served.peft_config) <= 2 and len(engine.adapters()) <= 2  # s, and one resolved at most
        assert "copy0" not in engine.adapters()  # evicted: forgotten
        shutil.rmtree(lookup / "copy0")
        with pytest.raises(UnknownAdapter):
            engine.submit(Request(prompt, adapter="copy0", max_tokens=5, temperature=0))
        shutil.copytree(folders["sources"]["plain"], lookup / "copy0")
        assert engine.submit(Request(prompt, adapter="copy0", max_tokens=5, temperature=0)).result(60) == expected
    finally:
        engine.stop()


def test_a_fifo_in_a_resolver_folder_stalls_no_one(folders, tmp_path):
    """A Hub cache whose refs/main is a FIFO, and a folder whose weights file is one: each is looked up
    and refused (or found by its snapshot) without waiting on the FIFO, and other requests are served."""
    hub = tmp_path / "hub"
    snapshot = hub_cache(hub, "org", "piped", folders["sources"]["cached"])
    main = snapshot.parent.parent / "refs" / "main"
    main.unlink()
    os.mkfifo(main)
    lookup = tmp_path / "lookup"
    shutil.copytree(folders["sources"]["plain"], lookup / "piped")
    os.remove(lookup / "piped" / "adapter_model.safetensors")
    os.mkfifo(lookup / "piped" / "adapter_model.safetensors")
    served = tiny_peft("llama", adapters=("s",), strength=0.6)
    ref = tiny_peft("llama", adapters=("s",), strength=0.6)
    ref.load_adapter(str(folders["sources"]["cached"]), adapter_name="cached")
    prompt = [9, 8, 7, 6]
    engine = Engine(served, max_batch=2, max_len=64, lora_resolver_dirs=[lookup, hub]).start()
    done = []
    try:
        def submit():
            with pytest.raises(Unreadable, match="not a regular file"):
                engine.submit(Request(prompt, adapter="piped", max_tokens=5, temperature=0))
            out = engine.submit(Request(prompt, adapter="org/piped", max_tokens=5, temperature=0)).result(60)
            done.append(out == standalone(ref, prompt, "cached", 5))
        thread = threading.Thread(target=submit, daemon=True)
        thread.start()
        thread.join(30)
        assert done == [True]
        assert engine.submit(Request(prompt, adapter="s", max_tokens=5, temperature=0)).result(30) == \
            standalone(ref, prompt, "s", 5)
    finally:
        engine.stop()


def test_over_http(files, folders, tmp_path):  # noqa: F811
    """The server with --lora-resolver-dir: 200 for an adapter found (then listed), 404 for a name
    found nowhere, 400 for a folder whose adapter cannot be served (not finite, made for another
    model, a folder as its weights file), 403 for a Hub snapshot whose file leads outside the cache."""
    with launch(files, tmp_path / "server.log", "--lora-resolver-dir", str(folders["lookup"]),
                "--lora-resolver-dir", str(folders["hub"])) as (url, _):
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        ok = call(url, "/v1/completions", dict(body, model="org/cached"), key=None)
        assert ok.status == 200 and ok.body["choices"][0]["finish_reason"] in ("length", "stop")
        assert "org/cached" in [m["id"] for m in call(url, "/v1/models", key=None).body["data"]]
        assert_error(call(url, "/v1/completions", dict(body, model="nowhere"), key=None), 404, "model_not_found")
        assert_error(call(url, "/v1/completions", dict(body, model="nan"), key=None), 400, "adapter_unsupported")
        for name in ("other", "dir"):  # weights shaped for another model; a folder as the weights file
            assert_error(call(url, "/v1/completions", dict(body, model=name), key=None), 400, "adapter_load_failed")
        assert call(url, "/v1/completions", dict(body, model="s"), key=None).status == 200
        assert_error(call(url, "/v1/completions", dict(body, model="org/leaky"), key=None), 403,
                     "lora_path_not_allowed")
