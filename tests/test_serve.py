"""The OpenAI-compatible server (hf_invisiblelora.serve) as a subprocess on a tiny random model,
driven with the ``openai`` client: greedy outputs equal standalone ``generate()`` of the same saved
model in this process, with mixed adapters and concurrent requests; streaming; stop strings; bad
input gets OpenAI error objects and harms nothing else; a client that disconnects mid-stream frees
its row; adapters load and unload while serving; seeded sampling repeats whatever runs beside it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from peft import PeftModel
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_invisiblelora.serving.cli import API_KEY_ENV, RUNTIME_LORA_ENV
from tiny import tiny_peft, tiny_tokenizer

ADAPTERS = ("s", "b", "c")
BASE_ID = "tiny"  # --served-model-name: the base model's id (no adapter)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
TEXTS = ["the quick brown fox", "once upon a time", "hello world", "over the lazy dog", "a cat", "there was"]
MAX_LEN = 1024


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny float32 Llama, its adapters s, b, c, a spare adapter (for loading while serving) and a
    tokenizer with a chat template, saved as a user's files would be."""
    root = tmp_path_factory.mktemp("serve")
    model = tiny_peft("llama", adapters=ADAPTERS, strength=0.6, dtype=torch.float32)
    model.save_pretrained(root / "adapters")  # one folder per adapter
    model.unload().save_pretrained(root / "base")
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(root / "base")
    spare = tiny_peft("llama", adapters=("d",), strength=0.6, seed=5, dtype=torch.float32)
    spare.save_pretrained(root / "spare")
    return root


@pytest.fixture(scope="module")
def reference(files):
    """The same saved files loaded in this process: (model with adapters s, b, c and "new", tokenizer)."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(files / "base"), files / "adapters" / "s",
                                      adapter_name="s")
    for name in ADAPTERS[1:]:
        model.load_adapter(files / "adapters" / name, adapter_name=name)
    model.load_adapter(files / "spare" / "d", adapter_name="new")
    return model.eval(), AutoTokenizer.from_pretrained(files / "base")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch(files, log_path, *args: str, env: dict | None = None):
    """The server on the saved files (adapters s, b, c; the base model as BASE_ID) with more
    command-line ``args`` (and environment ``env``), its output in ``log_path``: yields (base URL,
    process) once /health answers; the process is always terminated."""
    port = free_port()
    loras = [f"--lora={name}={files / 'adapters' / name}" for name in ADAPTERS]
    cmd = [sys.executable, "-P", "-m", "hf_invisiblelora.serve", "--model", str(files / "base"), *loras,
           "--served-model-name", BASE_ID, "--host", "127.0.0.1", "--port", str(port), "--max-batch", "4",
           "--max-len", str(MAX_LEN), "--num-draft-tokens", "2", "--gate", "always", "--threads", "1",
           "--log-level", "warning", *args]
    # The server reads these from the environment: only the test decides them.
    env = {**{k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, RUNTIME_LORA_ENV)}, **(env or {})}
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"the server exited ({proc.returncode}):\n{log.read()[-4000:]}")
                try:
                    if get(url, "/health")[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail("the server did not come up in 120 s")
                time.sleep(0.2)
            yield url, proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    """The server's base URL (adapters load while serving: --allow-runtime-lora-updating)."""
    with launch(files, tmp_path_factory.mktemp("serve_log") / "server.log", "--allow-runtime-lora-updating") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def request(url, path, body=None, raw: bytes | None = None):
    """(status, parsed JSON or text) of a GET (no body) or POST."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def get(url, path):
    return request(url, path)


def metrics(url) -> dict:
    """{(name, labels as a sorted tuple): value} of the /metrics samples."""
    status, text = get(url, "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_idle(url, timeout=20) -> dict:
    """/metrics once no row runs and nothing waits (and the server holds no request)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m[("hf_invisiblelora_running_rows", ())] == 0 and m[("hf_invisiblelora_queue_length", ())] == 0
                and get(url, "/health")[1]["in_flight"] == 0):
            return m
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def generate(reference, prompt_ids, adapter, max_tokens):
    """Standalone greedy generate() of one prompt: (new tokens up to EOS, their text)."""
    model, tok = reference
    adapter = "__base__" if adapter == BASE_ID else adapter
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), adapter_names=[adapter], max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, len(prompt_ids):].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id) + 1]
    return new, tok.decode(new, skip_special_tokens=True)


def check_choice(choice, usage, expected, prompt_len, max_tokens):
    tokens, text = expected
    assert choice_text(choice) == text
    assert choice.finish_reason == ("length" if len(tokens) == max_tokens and tokens[-1] != 1 else "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len, len(tokens))
    assert usage.total_tokens == prompt_len + len(tokens)


def choice_text(choice):
    return choice.message.content if hasattr(choice, "message") else choice.text


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [BASE_ID, *ADAPTERS]
    assert client.models.retrieve("b").id == "b"
    status, body = get(server, "/health")
    assert status == 200 and body["status"] == "ok" and body["adapters"] == list(ADAPTERS)


def test_completion_and_chat_equal_generate(client, reference):
    tok = reference[1]
    for adapter in ("s", BASE_ID):
        r = client.completions.create(model=adapter, prompt=TEXTS[0], max_tokens=12, temperature=0)
        ids = tok(TEXTS[0])["input_ids"]
        check_choice(r.choices[0], r.usage, generate(reference, ids, adapter, 12), len(ids), 12)
        assert r.object == "text_completion" and r.model == adapter
    messages = [{"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model="b", messages=messages, max_tokens=10, temperature=0)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    check_choice(r.choices[0], r.usage, generate(reference, ids, "b", 10), len(ids), 10)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"


def test_streaming(client):
    kw = dict(model="c", prompt=TEXTS[1], max_tokens=14, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices

    messages = [{"role": "user", "content": "once upon a time"}]
    whole = client.chat.completions.create(model="s", messages=messages, max_tokens=9, temperature=0)
    chunks = list(client.chat.completions.create(model="s", messages=messages, max_tokens=9, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_concurrent_mixed_adapters_equal_generate(server, client, reference):
    """32 requests from 8 threads, adapters mixed (and the base model), string and token-id
    prompts, different max_tokens: each equals standalone generate()."""
    tok = reference[1]
    models = [*ADAPTERS, BASE_ID]
    jobs = []
    g = torch.Generator().manual_seed(0)
    for i in range(32):
        if i % 2:
            prompt = torch.randint(2, 64, (1 + i % 7,), generator=g).tolist()
            ids = prompt
        else:
            prompt = TEXTS[i % len(TEXTS)]
            ids = tok(prompt)["input_ids"]
        jobs.append((prompt, ids, models[i % 4], 4 + i % 11))
    expected = [generate(reference, ids, model, n) for _, ids, model, n in jobs]
    before = metrics(server)

    def run(job):
        prompt, _, model, n = job
        return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    for (_, ids, _, n), want, r in zip(jobs, expected, results):
        check_choice(r.choices[0], r.usage, want, len(ids), n)

    after = wait_idle(server)
    tokens = sum(len(t) for t, _ in expected)
    assert after[("hf_invisiblelora_generated_tokens_total", ())] - before[("hf_invisiblelora_generated_tokens_total", ())] == tokens
    assert after[("hf_invisiblelora_requests_total", ())] - before[("hf_invisiblelora_requests_total", ())] == 32
    for name in ADAPTERS:  # --gate always: every adapter's requests had drafts judged
        assert after[("hf_invisiblelora_drafted_tokens_total", (("adapter", name),))] > 0
        assert 0 <= after[("hf_invisiblelora_accepted_tokens_total", (("adapter", name),))] <= \
            after[("hf_invisiblelora_drafted_tokens_total", (("adapter", name),))]
    assert after[("hf_invisiblelora_draft_tokens_per_cycle_count", ())] > 0
    assert after[("hf_invisiblelora_draft_tokens_per_cycle_bucket", (("le", "2.0"),))] == \
        after[("hf_invisiblelora_draft_tokens_per_cycle_count", ())]
    assert after[("hf_invisiblelora_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 32
    # vLLM's names for the same quantities (what cluster routers read): idle now; one time to first
    # token per completion; a time per output token for each request with tokens after its first.
    vllm = (("engine", "0"), ("model_name", BASE_ID))
    assert after[("vllm:num_requests_running", vllm)] == after[("vllm:num_requests_waiting", vllm)] == 0
    assert ("vllm:lora_requests_info", (("max_lora", "4"), ("running_lora_adapters", ""),
                                        ("waiting_lora_adapters", ""))) in after
    for name, count in (("vllm:time_to_first_token_seconds_count", 32),
                        ("vllm:time_per_output_token_seconds_count", sum(len(t) > 1 for t, _ in expected)),
                        ("hf_invisiblelora_time_per_output_token_seconds_count", sum(len(t) > 1 for t, _ in expected))):
        key = (name, vllm) if name.startswith("vllm") else (name, ())
        assert after[key] - before.get(key, 0) == count, name


def test_stop_strings(client, reference):
    tok = reference[1]
    ids = tok(TEXTS[2])["input_ids"]
    _, text = generate(reference, ids, "b", 20)
    # A stop string that first occurs mid-text (two characters), and one that never occurs.
    start = next(i for i in range(3, len(text) - 2) if text.find(text[i:i + 2]) == i)
    stop = text[start:start + 2]
    kw = dict(model="b", prompt=TEXTS[2], max_tokens=20, temperature=0, stop=[stop, "never-there"])
    r = client.completions.create(**kw)
    assert r.choices[0].text == text[:start] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 20
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:start]
    assert streamed[-1].choices[0].finish_reason == "stop"


def assert_error(e, status, code=None):
    assert e.status_code == status, e
    error = e.body if isinstance(e.body, dict) and "message" in e.body else e.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code:
        assert error["code"] == code


def test_bad_input(server, client):
    kw = dict(model="s", prompt="hello", max_tokens=4)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(**{**kw, "model": "nope"})
    assert_error(e.value, 404, "model_not_found")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert_error(e.value, 404, "model_not_found")
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens longer than the cache
        client.completions.create(**{**kw, "prompt": [5] * MAX_LEN})
    assert_error(e.value, 400, "context_length_exceeded")
    for bad in (dict(temperature=-0.5), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=-1), dict(n=0), dict(n=17),
                dict(logprobs=21), dict(prompt=[3, 64]), dict(prompt=[]), dict(prompt=""),
                dict(prompt=["one", "two"]), dict(stop=[""]), dict(seed="x"), dict(presence_penalty=2.5),
                dict(frequency_penalty=-3), dict(logit_bias={"64": 1}), dict(logit_bias={"3": 101}),
                dict(logit_bias={"x": 1})):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**kw, **bad})
        assert_error(e.value, 400)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"top_k": -3})
    assert_error(e.value, 400)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="s", messages=[])
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        status, body = request(server, "/v1/completions", raw=raw)
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = get(server, "/v1/nowhere")
    assert status == 404 and "error" in body
    # Nothing else was affected: the server serves, the engine runs, nothing is held.
    assert client.completions.create(**kw, temperature=0).choices[0].finish_reason in ("length", "stop")
    assert get(server, "/health")[0] == 200 and wait_idle(server)


def long_prompt(client, model, max_tokens=900):
    """A prompt whose greedy output with ``model`` runs the whole ``max_tokens`` (no EOS): asked of
    the server itself (greedy output is deterministic)."""
    for n in range(3, 12):
        prompt = list(range(2 + n, 2 + 2 * n))
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        if r.choices[0].finish_reason == "length":
            return prompt
    pytest.skip("no prompt without EOS found")


def test_client_disconnect_frees_the_row(server, client):
    prompt = long_prompt(client, "s")
    before = metrics(server)
    stream = client.completions.create(model="s", prompt=prompt, max_tokens=900, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away after its first chunk
    after = wait_idle(server)
    cancelled = ("hf_invisiblelora_requests_finished_total", (("finish_reason", "cancelled"),))
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == 1
    generated = ("hf_invisiblelora_generated_tokens_total", ())
    assert after[generated] - before[generated] < 900  # it stopped early
    # A non-streaming client that gives up (a timeout) is noticed as well.
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.3).completions.create(model="s", prompt=prompt, max_tokens=900, temperature=0)
    again = wait_idle(server)
    assert again.get(cancelled, 0) - before.get(cancelled, 0) == 2
    assert again[generated] - after[generated] < 900
    assert client.completions.create(model="b", prompt="hello", max_tokens=5, temperature=0).usage.completion_tokens


def adapter_call(url, path, body) -> tuple[int, str | None, str]:
    """(status, Content-Type, text) of a load or unload."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type"), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type"), e.read().decode()


def test_adapters_load_and_unload_while_serving(server, client, files, reference):
    """A load and an unload answer as vLLM's: 200, the text "Success: LoRA adapter 'NAME' added
    successfully." (removed, for an unload) and no Content-Type; errors are OpenAI error objects."""
    load = {"lora_name": "new", "lora_path": str(files / "spare" / "d")}
    assert adapter_call(server, "/v1/load_lora_adapter", load) == \
        (200, None, "Success: LoRA adapter 'new' added successfully.")
    assert "new" in [m.id for m in client.models.list().data]
    ids = [7, 8, 9, 10]
    r = client.completions.create(model="new", prompt=ids, max_tokens=8, temperature=0)
    check_choice(r.choices[0], r.usage, generate(reference, ids, "new", 8), len(ids), 8)
    # Refused: a taken name, a folder without an adapter.
    status, body = request(server, "/v1/load_lora_adapter", {"lora_name": "s", "lora_path": str(files / "spare" / "d")})
    assert status == 400 and body["error"]["code"] == "adapter_exists"
    status, body = request(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(files / "nowhere")})
    assert status == 400 and body["error"]["code"] == "adapter_load_failed"
    # Unloading while a request uses it: 409; once it is gone (the client disconnected): unloaded.
    prompt = long_prompt(client, "new")
    stream = client.completions.create(model="new", prompt=prompt, max_tokens=900, temperature=0, stream=True)
    next(iter(stream))
    status, body = request(server, "/v1/unload_lora_adapter", {"lora_name": "new"})
    assert status == 409 and body["error"]["code"] == "adapter_in_use"
    stream.close()
    deadline = time.monotonic() + 20
    while (answer := adapter_call(server, "/v1/unload_lora_adapter", {"lora_name": "new"}))[0] == 409:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert answer == (200, None, "Success: LoRA adapter 'new' removed successfully.")
    assert "new" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="new", prompt=ids, max_tokens=8)
    assert_error(e.value, 404, "model_not_found")
    assert request(server, "/v1/unload_lora_adapter", {"lora_name": "new"})[0] == 404
    r = client.completions.create(model="c", prompt=ids, max_tokens=6, temperature=0)  # the others still serve
    check_choice(r.choices[0], r.usage, generate(reference, ids, "c", 6), len(ids), 6)


def test_an_adapter_reloaded_in_place(server, client, files, reference):
    """vLLM's ``load_inplace``: a served name takes another folder's weights as a new revision (the
    answers are the new weights'); without it the name is taken; a bad value is a 400 naming it."""
    ids = [7, 8, 9, 10, 11]
    load = {"lora_name": "swap", "lora_path": str(files / "spare" / "d")}
    added = (200, None, "Success: LoRA adapter 'swap' added successfully.")
    assert adapter_call(server, "/v1/load_lora_adapter", load) == added
    r = client.completions.create(model="swap", prompt=ids, max_tokens=8, temperature=0)
    check_choice(r.choices[0], r.usage, generate(reference, ids, "new", 8), len(ids), 8)
    again = dict(load, lora_path=str(files / "adapters" / "c"))
    status, body = request(server, "/v1/load_lora_adapter", again)
    assert status == 400 and body["error"]["code"] == "adapter_exists"
    status, body = request(server, "/v1/load_lora_adapter", dict(again, load_inplace="yes"))
    assert status == 400 and body["error"]["param"] == "load_inplace"
    assert adapter_call(server, "/v1/load_lora_adapter", dict(again, load_inplace=True)) == added  # vLLM's words
    r = client.completions.create(model="swap", prompt=ids, max_tokens=8, temperature=0)
    check_choice(r.choices[0], r.usage, generate(reference, ids, "c", 8), len(ids), 8)
    status, body = request(server, "/v1/load_lora_adapter", dict(again, lora_path=str(files / "nowhere"),
                                                                 load_inplace=True))
    assert status == 400 and body["error"]["code"] == "adapter_load_failed"
    r = client.completions.create(model="swap", prompt=ids, max_tokens=8, temperature=0)  # as it was
    check_choice(r.choices[0], r.usage, generate(reference, ids, "c", 8), len(ids), 8)
    assert request(server, "/v1/unload_lora_adapter", {"lora_name": "swap"})[0] == 200


def test_seeded_sampling_repeats_with_others_in_flight(client):
    kw = dict(model="b", prompt=TEXTS[3], max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 20})
    alone = client.completions.create(**kw).choices[0].text
    others = [dict(model=m, prompt=TEXTS[i], max_tokens=24, temperature=1.0) for i, m in enumerate([*ADAPTERS, BASE_ID])]
    with ThreadPoolExecutor(6) as pool:
        busy = [pool.submit(client.completions.create, **o) for o in others]
        again = pool.submit(client.completions.create, **kw)
        assert again.result().choices[0].text == alone
        [f.result() for f in busy]
    assert client.completions.create(**{**kw, "seed": 99}).choices[0].text != alone  # the seed matters


def test_nothing_is_kept_after_requests(server):
    body = wait_idle(server) and get(server, "/health")[1]
    assert body["in_flight"] == 0 and body["running_rows"] == 0 and body["queue_length"] == 0


# --- incremental detokenization and stop strings, in process ---


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE tokenizer whose small vocabulary splits multi-byte characters across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(["plain ascii text, the end."] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.mark.parametrize("stops", [[], ["END"], ["☃ s"], ["zzz", "é"]])
def test_text_stream_never_splits_characters_and_cuts_at_stop_strings(byte_tokenizer, stops):
    from hf_invisiblelora.serving.text import Stops, TextStream

    text = "snow ☃ snowman, café crème ✓ END of 日本語 text"
    ids = byte_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in byte_tokenizer.decode([t]) for t in ids)  # some tokens are parts of characters
    cut = min([text.find(s) for s in stops if s in text] or [len(text)])
    for chunk in (1, 2, 3):  # the engine commits several tokens at a time
        stream, deltas, stopped_at = TextStream(byte_tokenizer, Stops(stops)), [], None
        for i in range(0, len(ids), chunk):
            deltas.append(stream.add(ids[i:i + chunk]))
            if stream.stopped and stopped_at is None:
                stopped_at = min(i + chunk, len(ids))
        deltas.append(stream.finish())
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == stream.text == text[:cut]
        assert stream.stopped == (cut < len(text))
        if stream.stopped:  # the tokens up to the one that completes the stop string; found in that chunk
            n = stream.completion_tokens
            assert any(s in byte_tokenizer.decode(ids[:n]) for s in stops)
            assert not any(s in byte_tokenizer.decode(ids[:n - 1]) for s in stops)
            assert stopped_at == min(len(ids), -(-n // chunk) * chunk)
        else:
            assert stream.completion_tokens == len(ids)


@pytest.mark.parametrize("which", ["byte_level_bpe", "smollm2"])
def test_incremental_text_equals_decoding_the_whole_output(byte_tokenizer, which, request):
    """The text stream decodes only each chunk's tokens (with the chunk before as context); with
    random chunk sizes, what it emits joins up to decoding all the tokens at once, for code, prose
    and multi-byte text, special tokens included: on a byte-level BPE trained here and on
    SmolLM2's real tokenizer (the zoo prepares it from its offline package)."""
    import pathlib
    import random

    from transformers import AutoTokenizer

    from hf_invisiblelora.serving.text import Stops, TextStream

    if which == "smollm2":
        tok = AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path"))
        special = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n  ok  "
    else:
        tok, special = byte_tokenizer, "plain <eos> text<eos> the end. <eos>"
    texts = [pathlib.Path(json.__file__).read_text()[:3000], "Once upon a time,  there   was\n\n\ta café — 日本語 ✓ 🙂🙂 end.",
             special]
    rng = random.Random(0)
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for _ in range(5):
            stream, out, i = TextStream(tok, Stops()), [], 0
            while i < len(ids):
                n = rng.randint(1, 5)
                out.append(stream.add(ids[i:i + n]))
                i += n
            out.append(stream.finish())
            assert "".join(out) == stream.text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("flag", ["lora", "model"])
def test_a_bad_path_at_start_is_one_line_and_exit_2(files, tmp_path, flag):
    """A missing folder (which PEFT or Transformers would take for a Hub repo id) is named in one
    line, before anything loads, and the server exits with status 2. (Lines before it may be other
    libraries' import-time warnings, e.g. torchao's on a CPU build of torch; none is a traceback.)"""
    gone = tmp_path / "no_such_folder"
    model, lora = (files / "base", gone) if flag == "lora" else (gone, files / "adapters" / "s")
    res = subprocess.run([sys.executable, "-P", "-m", "hf_invisiblelora.serve", "--model", str(model),
                          f"--lora=s={lora}"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    ours = [line for line in lines if line.startswith("error:")]
    assert ours == lines[-1:] and str(gone) in ours[0] and "not a folder" in ours[0], res.stderr
    assert "Traceback" not in res.stderr, res.stderr


def test_engine_options_come_from_one_definition():
    """The command line's engine options are options.Options and Limits: --draft-dtype float32 int8 int4
    the gate's choices as Engine(draft_dtype=) takes them, defaults and bad values those of the
    definitions (argparse's usage error naming the option)."""
    from hf_invisiblelora.options import Limits, Options
    from hf_invisiblelora.serving import cli

    args = cli.parse(["--model", "m"])
    engine = cli.engine_arguments(args)
    assert engine["draft_dtype"] == "auto" and engine["max_batch"] == Limits().max_batch
    assert engine["gate"] == Options().gate and engine["prepack"] == "auto"
    assert cli.engine_arguments(cli.parse(["--model", "m", "--draft-dtype", "int4"]))["draft_dtype"] is torch.int4
    several = cli.parse(["--model", "m", "--draft-dtype", "float32", "int8", "int4", "--prepack", "off"])
    assert cli.engine_arguments(several)["draft_dtype"] == (None, torch.int8, torch.int4)
    assert cli.engine_arguments(several)["prepack"] is False
    for bad, words in ((["--max-loras", "0"], "max-loras must be None or an int >= 1"),
                       (["--draft-dtype", "int8", "int8"], "distinct"), (["--max-batch", "0"], "max-batch"),
                       (["--draft-dtype", "auto", "int8"], "stands alone")):
        res = subprocess.run([sys.executable, "-P", "-m", "hf_invisiblelora.serve", "--model", "m", *bad],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr, res.stderr