"""Tenants isolated, over HTTP (issue 37; the engine's side is test_tenants.py), on test_serve.py's
server and tiny model:

- adapters with a NaN / Inf weight, a NaN lora_alpha, B * scaling overflowing, a rank past
  --max-lora-rank, a symlinked file or a name a router cannot carry are refused with a 4xx naming
  the cause, and the others' answers are unchanged; one whose weights overflow in its own rows'
  products is served beside the others, whose answers stay stock's;
- echo with logprobs (lm-evaluation-harness's local-completions scoring payload: token-id prompts,
  max_tokens 1 or 0), vLLM's prompt_logprobs, presence / frequency penalties and logit_bias against
  references computed here; usage with continuous_usage_stats only with include_usage; strict JSON.
"""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_serve import files, generate, launch, reference  # noqa: F401  # noqa: F401  (fixtures)
from test_serve_security import assert_error, call
from test_tenants import Bias, Penalties

from hf_invisiblelora.serving.cli import RUNTIME_LORA_ENV

KEY = "tenant-key"


@pytest.fixture(scope="module")
def root(files, tmp_path_factory):
    """--lora-root: copies of the spare adapter made bad in one way each, and a file symlinked outside."""
    root = tmp_path_factory.mktemp("tenant_root")
    spare = files / "spare" / "d"

    def copy(name, config=None, weights=None):
        folder = root / name
        shutil.copytree(spare, folder)
        if config:
            values = json.loads((folder / "adapter_config.json").read_text())
            (folder / "adapter_config.json").write_text(json.dumps({**values, **config}))
        if weights:
            tensors = load_file(folder / "adapter_model.safetensors")
            weights(tensors)
            save_file(tensors, folder / "adapter_model.safetensors")

    def first(part, value):
        def edit(t):
            t[next(k for k in t if part in k)].view(-1)[0] = value
        return edit

    def every(part, value):
        def edit(t):
            for k in t:
                if part in k:
                    t[k].fill_(value)
        return edit

    copy("good")
    copy("nan_b", weights=first("lora_B", float("nan")))
    copy("inf_a", weights=first("lora_A", float("inf")))
    copy("nan_alpha", config={"lora_alpha": float("nan")})
    copy("overflow", config={"lora_alpha": 64}, weights=every("lora_B", 3e38))
    copy("rank", config={"r": 4000})
    # Finite weights whose product with any token overflows: only its own rows are garbage.
    copy("big", weights=lambda t: [t[k].copy_(torch.sign(torch.randn_like(t[k])) * 3e38) for k in t if "lora_A" in k])
    linked = root / "linked"
    linked.mkdir()
    shutil.copy(spare / "adapter_config.json", linked)
    os.symlink(spare / "adapter_model.safetensors", linked / "adapter_model.safetensors")
    return root


@pytest.fixture(scope="module")
def server(files, root, tmp_path_factory):
    log = tmp_path_factory.mktemp("tenants_log") / "server.log"
    with launch(files, log, "--api-key", KEY, "--lora-root", str(root), "--max-lora-rank", "64",
                env={RUNTIME_LORA_ENV: "true"}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def load(server, name, folder):
    return call(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, key=KEY)


def answers(client, reference, jobs):
    """Each (adapter, prompt) of ``jobs`` at once; asserted equal to standalone generate()."""
    from concurrent.futures import ThreadPoolExecutor

    tok = reference[1]

    def one(job):
        name, text = job
        return client.completions.create(model=name, prompt=text, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs))
    for (name, text), g in zip(jobs, got):
        if name != "big":
            assert g == generate(reference, tok(text)["input_ids"], name, 8)[1], (name, text)


JOBS = [("s", "the quick brown fox"), ("big", "once upon a time"), ("b", "hello world"), ("big", "a cat"),
        ("c", "over the lazy dog"), ("tiny", "there was")]


@pytest.mark.parametrize("case, status, code, words", [
    ("nan_b", 400, "adapter_unsupported", "not finite"), ("inf_a", 400, "adapter_unsupported", "not finite"),
    ("nan_alpha", 400, "adapter_unsupported", "lora_alpha"), ("overflow", 400, "adapter_unsupported", "not finite"),
    ("rank", 400, "adapter_unsupported", "max-lora-rank"), ("linked", 403, "lora_path_not_allowed", "symlink")])
def test_bad_adapters_are_refused_and_harm_no_one(server, client, reference, root, case, status, code, words):
    reply = load(server, "new", root / case)
    assert reply.status == status, reply.body
    error = reply.body["error"]
    assert error["code"] == code and words in error["message"] and str(root) not in error["message"]
    assert [m.id for m in client.models.list().data] == ["tiny", "s", "b", "c"]
    answers(client, reference, [job for job in JOBS if job[0] != "big"])


def test_an_overflowing_adapter_shares_batches_harmlessly(server, client, reference, root):
    assert load(server, "big", root / "big").status == 200
    try:
        for _ in range(2):
            answers(client, reference, JOBS)
    finally:
        assert call(server, "/v1/unload_lora_adapter", {"lora_name": "big"}, key=KEY).status == 200


@pytest.mark.parametrize("name", ["comma,s", "a b", "", "x" * 200, "__base__", "new\n"])
def test_adapter_names_routers_cannot_carry_are_refused(server, root, name):
    reply = load(server, name, root / "good")
    assert reply.status == 400 and reply.body["error"]["param"] == "lora_name", reply.body


def test_a_good_adapter_loads_from_the_root(server, client, reference, root):
    assert load(server, "fine", root / "good").status == 200
    try:
        tok = reference[1]
        text = client.completions.create(model="fine", prompt="hello world", max_tokens=8, temperature=0).choices[0].text
        assert text == generate(reference, tok("hello world")["input_ids"], "new", 8)[1]  # the same weights as "new"
    finally:
        call(server, "/v1/unload_lora_adapter", {"lora_name": "fine"}, key=KEY)


# --- evaluation clients: prompt log-probabilities, penalties, logit bias ---------------------------


def prompt_reference(reference, ids, adapter):
    model, _ = reference
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), adapter_names=[adapter]).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_scoring_payload(server, reference, max_tokens):
    """local-completions' loglikelihood request: a batch of one token-id prompt, echo, logprobs 1,
    temperature 0; token_logprobs[ctxlen:-1] are summed, top_logprobs checked for greediness."""
    tok = reference[1]
    ids = tok("the quick brown fox jumps over the lazy dog")["input_ids"]
    body = {"model": "b", "prompt": [ids], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1, "echo": True,
            "seed": 1234}
    reply = call(server, "/v1/completions", body, key=KEY)
    assert reply.status == 200, reply.body
    choice = reply.body["choices"][0]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) + max_tokens and lps["token_logprobs"][0] is None
    assert lps["top_logprobs"][0] is None
    ref = prompt_reference(reference, ids, "b")
    for j in range(1, len(ids)):
        assert abs(lps["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < 1e-5
        top = lps["top_logprobs"][j]
        best = tok.decode([int(ref[j - 1].argmax())])
        assert best in top and abs(top[best] - float(ref[j - 1].max())) < 1e-5
    assert lps["text_offset"] == sorted(lps["text_offset"])
    if max_tokens == 0:
        assert choice["finish_reason"] == "length" and reply.body["usage"]["completion_tokens"] == 0


def test_echo_logprobs_streamed_as_whole(client):
    kw = dict(model="s", prompt="once upon a time", max_tokens=5, temperature=0, logprobs=2, echo=True)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens and values[0] is whole.logprobs.token_logprobs[0] is None
    # A token's log-probability comes from the pass that chose it (a plain step, or a verify pass over
    # several positions when the gate drafted), so two runs agree to float rounding, not bit for bit.
    assert values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_vllm_prompt_logprobs(server, reference):
    tok = reference[1]
    ids = tok("hello world")["input_ids"]
    ref = prompt_reference(reference, ids, "c")
    reply = call(server, "/v1/completions", {"model": "c", "prompt": ids, "max_tokens": 2, "temperature": 0,
                                             "prompt_logprobs": 3}, key=KEY)
    assert reply.status == 200, reply.body
    entries = reply.body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for j in range(1, len(ids)):
        row = ref[j - 1]
        item = entries[j][str(ids[j])]
        assert abs(item["logprob"] - float(row[ids[j]])) < 1e-5 and item["rank"] == int((row > row[ids[j]]).sum()) + 1
        assert {int(t) for t in entries[j]} >= set(row.topk(3).indices.tolist())
    chat = call(server, "/v1/chat/completions", {"model": "c", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "prompt_logprobs": 0}, key=KEY)
    assert chat.status == 200 and chat.body["prompt_logprobs"][0] is None and len(chat.body["prompt_logprobs"]) > 1
    streamed = call(server, "/v1/completions", {"model": "c", "prompt": ids, "prompt_logprobs": 1, "stream": True},
                    key=KEY)
    assert_error(streamed, 400, "unsupported_parameter")


@pytest.mark.parametrize("options", [dict(presence_penalty=1.5, frequency_penalty=0.5),
                                     dict(logit_bias={"7": 8.0, "12": -100})])
def test_penalties_and_logit_bias_over_http(client, reference, options):
    model, tok = reference
    ids = tok("there was")["input_ids"]
    got = client.completions.create(model="s", prompt=ids, max_tokens=10, temperature=0, **options)
    from transformers import LogitsProcessorList

    bias = {int(k): v for k, v in options.get("logit_bias", {}).items()}
    processors = LogitsProcessorList([Bias(bias), Penalties(len(ids), options.get("presence_penalty", 0.0),
                                                            options.get("frequency_penalty", 0.0))])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), adapter_names=["s"], max_new_tokens=10, do_sample=False,
                             logits_processor=processors, pad_token_id=tok.pad_token_id)
    new = out[0, len(ids):].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id) + 1]
    assert got.choices[0].text == tok.decode(new, skip_special_tokens=True)


def test_continuous_usage_needs_include_usage(server):
    body = {"model": "s", "prompt": "hello", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    reply = call(server, "/v1/completions", body, key=KEY)
    events = [json.loads(line[6:]) for line in reply.body.splitlines() if line.startswith("data: {")]
    assert events and not any("usage" in e for e in events)


def test_logprobs_are_strict_json():
    from hf_invisiblelora.serving.bridge import _finite

    assert json.dumps([_finite(float("nan")), _finite(float("-inf")), _finite(-1.5)], allow_nan=False) == \
        "[-9999.0, -9999.0, -1.5]"


def test_ray_router_reads_any_body_without_raising():
    pytest.importorskip("ray")
    from starlette.requests import Request

    from hf_invisiblelora.serving.ray_app import Router

    Router = Router.func_or_class  # the class under Serve's deployment
    scope = {"type": "http", "method": "POST", "headers": [(b"content-type", b"application/json")]}
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"model": "s", "n": ' + b"9" * 5000 + b"}", b"\xff", b'"x"'):
        assert Router.adapter(Request(scope), body) == ""
    assert Router.adapter(Request(scope), b'{"model": "s"}') == "s"
