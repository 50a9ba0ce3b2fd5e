"""Tenants isolated (issue 37), on the engine and generate(); the server's side is test_serve_tenants.py.

- A bad adapter never touches another row's output: one whose weights overflow in a row's
  product (finite, near 3e38) shares mixed batches with others on every LoRA path (packed, gathered,
  padded), and their rows are stock PEFT's; one whose weights or scaling are not finite is refused,
  by generate() up front and by the engine at load, with the model as before.
- A load that fails, at any point and for any reason, leaves the model's modules, parameters and
  memory as they were.
- Files are read inside the roots at the moment they are read: a symlinked file, a folder that is a
  symlink (as a folder swapped after the server's check), a folder outside.
- The rank is bounded before anything is allocated (``max_lora_rank``); adapter names are checked.
- Prompt log-probabilities, ``max_tokens=0``, presence / frequency penalties and logit bias, each
  against a reference (a forward pass's log-softmax; stock generate() with the penalties as a logits
  processor written here).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.engine import AdapterUnsupported, Engine, InvalidRequest, Request, adapters
from hf_invisiblelora.lora import layer as lora_layer
from hf_invisiblelora.lora.files import OutsideRoots, Unreadable
from tiny import prompts, tiny_peft

ROWS = ["s", "big", "b", "__base__", "c", "big"]


def overflowing(model, name="big"):
    """Adapter ``name`` of ``model`` with finite weights whose products with a token overflow to
    Inf (A near 3e38): its own rows' outputs are garbage, as in stock PEFT; no one else's may be."""
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_A") and name in m.lora_A:
                m.lora_A[name].weight.copy_(torch.sign(torch.randn_like(m.lora_A[name].weight)) * 3e38)
    return model


@pytest.mark.parametrize("path", lora_layer.PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gate", ["never", "always"])
def test_an_overflowing_adapter_leaves_other_rows_as_stock(monkeypatch, path, dtype, gate):
    monkeypatch.setattr(lora_layer, "FORCE_PATH", path)
    adapters = {"s": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                "big": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"]),
                "b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "up_proj", "down_proj"]),
                "c": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "down_proj"])}
    model = overflowing(tiny_peft("llama", adapters=adapters, strength=0.6, dtype=dtype))
    ids, mask = prompts([5, 7, 3, 6, 4, 2])
    kw = dict(input_ids=ids, attention_mask=mask, adapter_names=ROWS, do_sample=False, max_new_tokens=8, pad_token_id=0)
    stock = model.generate(**kw)
    ours = model.generate(**kw, invisible_lora=True, gate=gate, num_draft_tokens=2, prepack=False)
    for row, name in enumerate(ROWS):
        if name != "big":
            assert ours[row].tolist() == stock[row].tolist(), (row, name)


@pytest.mark.parametrize("gate", ["never", "always"])
def test_a_row_reused_after_an_overflowing_adapter_reads_nothing_of_it(gate):
    """The engine's rows are reused: a request in the row an overflowing adapter's request left (NaN
    keys and values in its slots, which attention reads under the mask) decodes as stock."""
    adapters = {"s": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                "big": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"])}
    model = overflowing(tiny_peft("llama", adapters=adapters, strength=0.6, dtype=torch.float32))
    g = torch.Generator().manual_seed(0)
    jobs = [(torch.randint(2, 64, (n,), generator=g).tolist(), a)
            for n, a in [(6, "big"), (3, "big"), (4, "__base__"), (5, "s"), (7, "__base__"), (2, "s")]]
    engine = Engine(model, max_batch=2, max_len=48, num_draft_tokens=2, gate=gate).start()
    try:
        handles = [engine.submit(Request(p, adapter=a, max_tokens=8, temperature=0)) for p, a in jobs]
        for h, (p, a) in zip(handles, jobs):
            h.result(60)
            if a != "big":
                assert h.tokens == model.generate(input_ids=torch.tensor([p]), adapter_names=[a], max_new_tokens=8,
                                                  do_sample=False)[0, len(p):].tolist(), a
    finally:
        engine.stop()


@pytest.mark.parametrize("where", ["lora_A", "lora_B", "scaling"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_generate_refuses_an_adapter_that_is_not_finite(where, value):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts([4, 6, 3])
    q = model.get_base_model().model.layers[1].self_attn.q_proj
    with torch.no_grad():
        if where == "scaling":
            q.scaling["b"] = value
        else:
            getattr(q, where)["b"].weight[0, 0] = value
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, invisible_lora=True)
    with pytest.raises(ValueError, match="Adapter 'b' has weights or a scaling that are not finite"):
        model.generate(**kw, adapter_names=["s", "b", "c"])
    # The others are served, in the same model: only a call whose rows use it is refused.
    assert torch.equal(model.generate(**kw, adapter_names=["s", "__base__", "c"]),
                       model.generate(**{**kw, "invisible_lora": False}, adapter_names=["s", "__base__", "c"]))


# --- loading: refused adapters, failed loads, roots, rank, names -----------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A folder with the tiny model's adapter "d" saved (PEFT's files), and its contents."""
    folder = tmp_path_factory.mktemp("donor")
    tiny_peft("llama", adapters=("d",), strength=0.6, seed=5).save_pretrained(folder)
    path = folder / "d" if (folder / "d").exists() else folder
    return path


def variant(saved, tmp_path, name, config=None, weights=None, remove=()):
    """A copy of the saved adapter in tmp_path/name with its config updated by ``config`` and its
    weights changed by ``weights(dict)`` (in place)."""
    folder = tmp_path / name
    shutil.copytree(saved, folder)
    if config is not None:
        values = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**values, **config}))
    if weights is not None:
        tensors = load_file(folder / "adapter_model.safetensors")
        weights(tensors)
        save_file(tensors, folder / "adapter_model.safetensors")
    for file in remove:
        (folder / file).unlink()
    return folder


def structure(model):
    """What a load must leave as it was: every module (by name and identity) and every parameter."""
    return ([(n, id(m)) for n, m in model.named_modules()], [(n, id(p), p.shape) for n, p in model.named_parameters()],
            dict(model.peft_config), list(model.active_adapters))


def first(tensors, part):
    return next(k for k in tensors if part in k)


def set_first(part, value):
    def edit(tensors):
        tensors[first(tensors, part)].view(-1)[0] = value
    return edit


def near_max(part):
    """Every ``part`` tensor at half its dtype's largest value: finite, but B * scaling overflows."""
    def edit(tensors):
        for k in tensors:
            if part in k:
                tensors[k].fill_(torch.finfo(tensors[k].dtype).max / 2)
    return edit


def truncate(folder):
    data = (folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


REFUSED = {  # name -> (variant kwargs, exception, words of its message)
    "nan_B": (dict(weights=set_first("lora_B", float("nan"))), AdapterUnsupported, "not finite"),
    "inf_A": (dict(weights=set_first("lora_A", float("inf"))), AdapterUnsupported, "not finite"),
    "overflow_B": (dict(weights=near_max("lora_B"), config=dict(lora_alpha=64)), AdapterUnsupported,
                   "not finite"),
    "nan_alpha": (dict(config=dict(lora_alpha=float("nan"))), AdapterUnsupported, "lora_alpha"),
    "huge_rank": (dict(config=dict(r=100000)), AdapterUnsupported, "max-lora-rank"),
    "pattern_rank": (dict(config=dict(rank_pattern={"up_proj": 999})), AdapterUnsupported, "max-lora-rank"),
    "pissa": (dict(config=dict(init_lora_weights="pissa")), AdapterUnsupported, "rewrites the base"),
    "bad_module": (dict(config=dict(target_modules=["up_proj", "act_fn"], r=64)), ValueError, "not supported"),
    "missing_weights": (dict(remove=["adapter_model.safetensors"]), Unreadable, "neither"),
    "no_config": (dict(remove=["adapter_config.json"]), Unreadable, "adapter_config.json"),
    "bad_json": (dict(config=None), Unreadable, "not valid JSON"),
    "other_model": (dict(weights=lambda t: [t.pop(k) for k in [k for k in t if "up_proj" in k]]), Unreadable,
                    "lack"),
    "truncated": (dict(), Unreadable, "safetensors"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_or_failed_load_leaves_the_model_as_it_was(saved, tmp_path, case):
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    kwargs, error, words = REFUSED[case]
    folder = variant(saved, tmp_path, case, **kwargs)
    if case == "bad_json":
        (folder / "adapter_config.json").write_text("{not json")
    if case == "truncated":
        truncate(folder)
    engine = Engine(model, max_batch=2, max_len=48, num_draft_tokens=2, gate="always").start()
    try:
        before = structure(model)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(2, 64, (5,), generator=g).tolist()
        answer = engine.submit(Request(prompt, adapter="b", max_tokens=6, temperature=0)).result(60)
        with pytest.raises(error, match=words):
            engine.load_adapter("new", str(folder))
        assert structure(model) == before
        assert engine.adapters() == ["s", "b"] and engine.error is None
        assert engine.submit(Request(prompt, adapter="b", max_tokens=6, temperature=0)).result(60) == answer
        engine.load_adapter("new", str(saved))  # the name is free: nothing was left half-loaded
        assert engine.submit(Request(prompt, adapter="new", max_tokens=6, temperature=0)).result(60) == \
            model.generate(input_ids=torch.tensor([prompt]), adapter_names=["new"], max_new_tokens=6,
                           do_sample=False)[0, len(prompt):].tolist()
    finally:
        engine.stop()


def test_failed_loads_keep_no_memory(saved, tmp_path):
    """Six loads that fail late in PEFT's injection (a rank-256 adapter on every linear layer and the
    final norm, which PEFT cannot wrap and meets last) on SmolLM2's shape: each allocates ~310 MB of
    LoRA weights before it fails, and the process's memory comes back each time (failed loads kept
    theirs on the real model before)."""
    from tiny import smollm2_shaped

    model = smollm2_shaped({"s": dict(r=4, lora_alpha=8, target_modules=["q_proj"])})
    config = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                  "norm"], r=256, lora_alpha=256)
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({**json.loads((saved / "adapter_config.json").read_text()),
                                                            **config}))
    save_file({}, folder / "adapter_model.safetensors")
    pool = adapters.AdapterManager(model, None, None)

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    before = structure(model)
    with pytest.raises(ValueError):
        pool.add("bad", pool.read(str(folder)), str(folder))  # the first one: allocator arenas settle
    start = rss()
    for _ in range(6):
        with pytest.raises(ValueError, match="not supported"):
            pool.add("bad", pool.read(str(folder)), str(folder))
    assert structure(model) == before
    assert rss() - start < 64 * 2**20, (start, rss())


def test_files_are_read_inside_the_roots(saved, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = variant(saved, tmp_path, "outside")
    inside = variant(saved, root, "inside")
    linked_file = root / "linked_file"
    linked_file.mkdir()
    shutil.copy(saved / "adapter_config.json", linked_file)
    os.symlink(outside / "adapter_model.safetensors", linked_file / "adapter_model.safetensors")
    swapped = root / "swapped"  # a folder swapped for a symlink to another after a check of its path
    os.symlink(outside, swapped)
    model = tiny_peft("llama", adapters=("s",), strength=0.6)
    pool = adapters.AdapterManager(model, None, None)
    roots = [os.path.realpath(root)]
    before = structure(model)
    for folder, words in [(linked_file, "symlink"), (swapped, "cannot be opened|outside"), (outside, "outside")]:
        with pytest.raises((OutsideRoots, Unreadable), match=words):
            pool.add("x", pool.read(str(folder), roots), str(folder), roots)
        assert structure(model) == before
    pool.add("x", pool.read(str(inside), roots), str(inside), roots)
    assert "x" in model.peft_config


def test_names_are_checked():
    model = tiny_peft("llama", adapters=("s",), strength=0.6)
    engine = Engine(model, max_batch=1, max_len=32)
    for bad in ["comma,h_kjv", "", "a b", "x" * 129, "__base__", "-dash", "new\nline", 'q"uote', 7]:
        with pytest.raises(ValueError, match="Adapter names are"):
            engine.load_adapter(bad, "/nowhere")
    with pytest.raises(ValueError, match="Adapter names are"):
        Engine(model, adapter_paths={"two,names": "/nowhere"})
    for good in ["kjv", "org/adapter-v1.2", "a:b_c"]:
        adapters.check_name(good)


# --- prompt log-probabilities, max_tokens=0, penalties, logit bias ---------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_peft("llama", strength=0.6)


def run(model, requests, **options):
    engine = Engine(model, max_batch=3, max_len=48, num_draft_tokens=2, gate="always", **options).start()
    try:
        handles = [engine.submit(r) for r in requests]
        for h in handles:
            h.result(60)
        return handles
    finally:
        engine.stop()


@pytest.mark.parametrize("chunk", [None, 4])
def test_prompt_logprobs_are_the_forward_pass_log_softmax(model, chunk):
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randint(2, 64, (n,), generator=g).tolist(), a, k, top)
             for n, a, k, top in [(6, "s", 3, 2), (9, "b", 0, 5), (2, "__base__", 1, 0), (12, "c", 4, 1)]]
    handles = run(model, [Request(p, adapter=a, max_tokens=k, temperature=0, prompt_logprobs=top)
                          for p, a, k, top in cases], prefill_chunk=chunk)
    for h, (p, a, k, top) in zip(handles, cases):
        assert len(h.tokens) == k and h.finish_reason in ("length", "stop")
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([p]), adapter_names=[a]).logits[0].float().log_softmax(-1)
        assert h.prompt_logprobs[0] is None and len(h.prompt_logprobs) == len(p)
        for j, (lp, rank, best) in enumerate(h.prompt_logprobs[1:]):
            row = ref[j]
            assert abs(lp - float(row[p[j + 1]])) < 1e-6
            assert rank == int((row > row[p[j + 1]]).sum()) + 1
            assert [t for t, _ in best] == row.topk(top).indices.tolist()


def test_max_tokens_zero_answers_the_prompt_only(model):
    h, = run(model, [Request([5, 9, 2, 7], adapter="b", max_tokens=0, temperature=0, prompt_logprobs=0)])
    assert h.tokens == [] and h.finish_reason == "length" and len(h.prompt_logprobs) == 4


class Bias:
    """The reference of OpenAI's logit bias, as a logits processor for stock generate() (written here,
    apart from the engine's)."""

    def __init__(self, bias):
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


class Penalties:
    """The reference of OpenAI's presence / frequency penalties over the output, likewise."""

    def __init__(self, prompt_len, presence=0.0, frequency=0.0):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            out = input_ids[row, self.prompt_len:].tolist()
            for token in set(out):
                scores[row, token] -= self.frequency * out.count(token) + self.presence
        return scores


@pytest.mark.parametrize("options", [dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
                                     dict(presence_penalty=-0.5, frequency_penalty=1.2),
                                     dict(logit_bias={7: 5.0, 11: -100, 30: 3.5}),
                                     dict(logit_bias={"9": 4.0}, frequency_penalty=0.4, repetition_penalty=1.3)])
def test_penalties_and_logit_bias_as_stock_with_them_as_a_processor(model, options):
    g = torch.Generator().manual_seed(2)
    cases = [(torch.randint(2, 64, (n,), generator=g).tolist(), a) for n, a in [(5, "s"), (8, "b"), (3, "__base__")]]
    handles = run(model, [Request(p, adapter=a, max_tokens=12, temperature=0, **options) for p, a in cases])
    bias = {int(k): v for k, v in (options.get("logit_bias") or {}).items()}
    for h, (p, a) in zip(handles, cases):
        # vLLM's order: the bias, the repetition penalty, then presence and frequency.
        reference = [Bias(bias)] + ([RepetitionPenaltyLogitsProcessor(options["repetition_penalty"])]
                                    if "repetition_penalty" in options else []) + \
            [Penalties(len(p), options.get("presence_penalty", 0.0), options.get("frequency_penalty", 0.0))]
        stock = model.generate(input_ids=torch.tensor([p]), adapter_names=[a], max_new_tokens=12, do_sample=False,
                               logits_processor=LogitsProcessorList(reference))
        assert h.tokens == stock[0, len(p):].tolist()
    plain = run(model, [Request(p, adapter=a, max_tokens=12, temperature=0) for p, a in cases])
    assert any(h.tokens != q.tokens for h, q in zip(handles, plain))  # they changed something


@pytest.mark.parametrize("bad, param", [(dict(presence_penalty=2.5), "presence_penalty"),
                                        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                        (dict(logit_bias={"64": 1.0}), "logit_bias"),
                                        (dict(logit_bias={"3": 101}), "logit_bias"),
                                        (dict(logit_bias={"3": float("nan")}), "logit_bias"),
                                        (dict(logit_bias={"x": 1}), "logit_bias"),
                                        (dict(prompt_logprobs=21), "prompt_logprobs"),
                                        (dict(max_tokens=-1), "max_tokens"),
                                        (dict(stop_token_ids=[3, 99]), "stop_token_ids")])
def test_bad_values_name_their_field(model, bad, param):
    engine = Engine(model, max_batch=1, max_len=32)
    with pytest.raises(InvalidRequest) as e:
        engine.validate(Request([3, 4], adapter="s", **bad))
    assert e.value.param == param
    if param == "stop_token_ids":
        assert "99" in str(e.value)
