"""The server under attack (hf_invisiblelora.serve; docs/serving.md, "Security model"): the API key,
runtime adapter loading and its roots, content types, bodies that broke it (deep JSON, huge
integers, lone surrogates, oversized bodies), a tiny temperature, the error codes of adapter
loading, no internal detail in any error body, /v1/models roots, an event loop that tokenizing a
1 MB prompt does not block, clients that vanish mid-stream, and SIGTERM under load. Every error
body is checked for tracebacks, exception text and paths, and after each error case the server
still answers a normal request correctly.

The servers are subprocesses on test_serve.py's tiny model (its fixtures and helpers); the last
tests drive the app in process, where failures can be injected."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import signal
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest
import torch
from test_serve import (  # noqa: F401
    BASE_ID,
    CHAT_TEMPLATE,
    TEXTS,
    files,
    generate,
    launch,
    long_prompt,
    metrics,
    reference,
    wait_idle,
)

import hf_invisiblelora
from hf_invisiblelora.serving.cli import API_KEY_ENV, RUNTIME_LORA_ENV
from tiny import tiny_peft

KEY = "test-key-7f3a9c"
BODY_LIMIT = 2 * 2**20  # --max-body-bytes of the main server: a 1 MB prompt fits
ONE_MB = 2**20
SHORT_TOKENS = 60  # a stream in flight at SIGTERM that finishes well within --shutdown-timeout


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: object  # parsed JSON, else the text


def call(url, path, body=None, *, raw: bytes | None = None, key: str | None = KEY,
         content_type: str | None = "application/json", chunked: bool = False, timeout: float = 60) -> Reply:
    """One request by hand (http.client: any content type, or none): a GET without a body, else a
    POST of ``raw`` or ``body`` as JSON (``chunked``: without a Content-Length)."""
    parts = urllib.parse.urlsplit(url)
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if data is not None and content_type:
        headers["Content-Type"] = content_type
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        if chunked:
            pieces = (data[i:i + 65536] for i in range(0, len(data), 65536))
            conn.request("POST", path, body=pieces, headers=headers, encode_chunked=True)
        else:
            conn.request("GET" if data is None else "POST", path, body=data, headers=headers)
        r = conn.getresponse()
        text = r.read().decode()
    finally:
        conn.close()
    try:
        return Reply(r.status, r.headers, json.loads(text))
    except json.JSONDecodeError:
        return Reply(r.status, r.headers, text)


def declared_too_large(url, path, size: int) -> Reply:
    """A POST whose Content-Length says ``size`` bytes, none of them sent: the server must answer
    from the header alone."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest("POST", path)
        for name, value in (("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
                            ("Content-Length", str(size))):
            conn.putheader(name, value)
        conn.endheaders()
        r = conn.getresponse()
        return Reply(r.status, r.headers, json.loads(r.read()))
    finally:
        conn.close()


def open_stream(url, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion by hand: (connection, response), the response's head read."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def events(r: http.client.HTTPResponse, count: int | None = None) -> list[str]:
    """The data of the next ``count`` server-sent events (None: all, to the end of the response)."""
    found = []
    while count is None or len(found) < count:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            found.append(line[6:].decode().strip())
    return found


EXCEPTION_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception)\b")


def assert_clean(text: str, *paths) -> None:
    """No traceback, no exception's name or text, no path of ours, the library's or the test's."""
    assert "Traceback" not in text and 'File "' not in text and ".py" not in text, text
    assert not EXCEPTION_NAME.search(text), text
    for path in (sys.prefix, hf_invisiblelora.__file__.rsplit("/", 2)[0], *map(str, paths)):
        assert path not in text, (path, text)


def assert_error(reply: Reply, status: int, code: str, *paths) -> dict:
    """An OpenAI error object with this status and code, clean (assert_clean), with a request id."""
    assert reply.status == status, reply
    error = reply.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], reply.body
    assert error["code"] == code, reply.body
    assert_clean(json.dumps(reply.body), *paths)
    assert re.fullmatch(r"[0-9a-f]{32}", reply.headers["X-Request-Id"])
    return error


# --- the main server: --api-key, runtime loading (from the environment), a root, a body limit ---


@pytest.fixture(scope="module")
def lora_root(files, tmp_path_factory):
    """The folder runtime loading may read: a copy of the spare adapter (d), a symlink out of it, a
    folder without an adapter, an adapter whose weights are missing, and a lora_bias adapter (which
    PEFT loads and the engine refuses)."""
    root = tmp_path_factory.mktemp("lora_root")
    shutil.copytree(files / "spare" / "d", root / "d")
    (root / "escape").symlink_to(files / "spare" / "d", target_is_directory=True)
    (root / "empty").mkdir()
    (root / "broken").mkdir()
    shutil.copy(files / "spare" / "d" / "adapter_config.json", root / "broken")
    trains = {"m": dict(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True)}
    tiny_peft("llama", adapters=trains, dtype=torch.float32).save_pretrained(root / "whole")
    return root


PIDS = {}  # server URL -> its process id (rss)


def rss(url) -> int:
    """The server process's resident memory, in bytes."""
    with open(f"/proc/{PIDS[url]}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def server(files, lora_root, tmp_path_factory):
    log = tmp_path_factory.mktemp("security_log") / "server.log"
    with launch(files, log, "--api-key", KEY, "--lora-root", str(lora_root), "--max-body-bytes", str(BODY_LIMIT),
                env={RUNTIME_LORA_ENV: "true"}) as (url, proc):
        PIDS[url] = proc.pid
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


NORMAL = dict(model="s", prompt=TEXTS[0], max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def serves(client, reference):
    """A check that the server answers a normal request correctly (standalone generate()'s text)."""
    ids = reference[1](NORMAL["prompt"])["input_ids"]
    expected = generate(reference, ids, NORMAL["model"], NORMAL["max_tokens"])[1]

    def check():
        assert client.completions.create(**NORMAL).choices[0].text == expected
    return check


@pytest.fixture(scope="module")
def endless(client):
    """A prompt whose greedy output with adapter s runs 900 tokens (no EOS), the same on every
    server of these files."""
    return long_prompt(client, "s")


@pytest.fixture(scope="module")
def endless_seconds(client, endless):
    """How long the endless prompt's 900 tokens take alone on this machine (a server as the others)."""
    start = time.monotonic()
    client.completions.create(model="s", prompt=endless, max_tokens=900, temperature=0)
    return time.monotonic() - start


def adapter_ids(client) -> list[str]:
    return [m.id for m in client.models.list().data]


def test_api_key(server, client, serves):
    """Every /v1 route wants the key (401 without it, or with another, and nothing runs); /health
    and /metrics are open."""
    routes = [("/v1/models", None), ("/v1/models/s", None), ("/v1/completions", dict(NORMAL)),
              ("/v1/chat/completions", {"model": "s", "messages": [{"role": "user", "content": "hi"}]}),
              ("/v1/load_lora_adapter", {"lora_name": "k", "lora_path": "d"}),
              ("/v1/unload_lora_adapter", {"lora_name": "s"})]
    before = metrics(server)
    for path, body in routes:
        for key in (None, "wrong", KEY + "x", KEY[:-1]):
            reply = call(server, path, body, key=key)
            assert_error(reply, 401, "invalid_api_key")
            assert reply.headers["WWW-Authenticate"] == "Bearer"
    after = metrics(server)
    tokens = ("hf_invisiblelora_prompt_tokens_total", ())
    assert after[tokens] == before[tokens] and adapter_ids(client) == [BASE_ID, "s", "b", "c"]  # nothing ran
    assert call(server, "/v1/models").status == 200 and call(server, "/v1/models/s").body["id"] == "s"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    for path in ("/health", "/metrics"):  # open, as the docs' security model says
        assert call(server, path, key=None).status == 200
    serves()


def test_v1_models_roots(server, files, client):
    """`root` is the folder each model was loaded from, as given."""
    roots = {m.id: (m.root, m.parent) for m in client.models.list().data}
    assert roots[BASE_ID] == (str(files / "base"), None)
    for name in ("s", "b", "c"):
        assert roots[name] == (str(files / "adapters" / name), BASE_ID)


def test_runtime_loading_inside_and_outside_the_root(server, client, files, lora_root, reference, serves):
    """A lora_path outside the --lora-root once resolved (symlinks, ``..``; whether it exists or not)
    is 403 and loads nothing; one inside loads, and its adapter decodes as standalone generate()."""
    outside = [files / "spare" / "d", lora_root / "escape", f"{lora_root}/../{files.name}/spare/d",
               f"{lora_root}/d/../../{files.name}/spare/d", files / "spare" / "none", "/etc", "~", "d"]
    for path in outside:
        reply = call(server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(path)})
        assert_error(reply, 403, "lora_path_not_allowed", files, lora_root)
        assert "new" not in adapter_ids(client)
        serves()
    reply = call(server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": f"{lora_root}\x00/d"})
    assert_error(reply, 400, "invalid_value", lora_root)
    inside = f"{lora_root}/empty/../d"
    reply = call(server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": inside})
    assert reply.status == 200, reply.body
    assert {m.id: m.root for m in client.models.list().data}["new"] == inside  # the path as given
    ids = [7, 8, 9, 10]
    r = client.completions.create(model="new", prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == generate(reference, ids, "new", 8)[1]
    assert call(server, "/v1/unload_lora_adapter", {"lora_name": "new"}).status == 200
    assert "new" not in adapter_ids(client)


def test_adapter_load_error_codes(server, client, files, lora_root, serves):
    """Each refused load has its code, says nothing of PEFT's error, and leaves nothing loaded."""
    cases = [("nope", "adapter_load_failed"),  # no such folder (PEFT would ask the Hub for it)
             ("empty", "adapter_load_failed"),  # no adapter_config.json
             ("broken", "adapter_load_failed"),  # no weights: PEFT's own error, whose text names the path
             ("whole/m", "adapter_unsupported"),  # lora_bias: the engine refuses it
             ("d", "adapter_exists")]  # under a name in use
    for folder, code in cases:
        name = "s" if code == "adapter_exists" else "new"
        reply = call(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(lora_root / folder)})
        error = assert_error(reply, 400, code, files, lora_root)
        assert error["param"] == ("lora_name" if code == "adapter_exists" else "lora_path")
        if code == "adapter_unsupported":  # the engine's reason, in its words
            assert "lora_bias" in error["message"]
        assert adapter_ids(client) == [BASE_ID, "s", "b", "c"]
        serves()
    # The refused names load fine afterwards: nothing was left half-loaded.
    assert call(server, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(lora_root / "d")}).status == 200
    assert call(server, "/v1/unload_lora_adapter", {"lora_name": "new"}).status == 200


def test_concurrent_loads_under_one_name(server, client, lora_root, serves):
    """Several loads under one new name at once: exactly one loads it, the others get adapter_exists."""
    barrier = threading.Barrier(4)

    def load(_):
        barrier.wait()
        return call(server, "/v1/load_lora_adapter", {"lora_name": "twin", "lora_path": str(lora_root / "d")})

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(load, range(4)))
    assert sorted(r.status for r in replies) == [200, 400, 400, 400], [r.body for r in replies]
    for r in replies:
        if r.status == 400:
            assert_error(r, 400, "adapter_exists", lora_root)
    assert adapter_ids(client).count("twin") == 1
    assert call(server, "/v1/unload_lora_adapter", {"lora_name": "twin"}).status == 200
    serves()


def test_content_types(server, client, lora_root, serves):
    """Anything but application/json is refused (415) before it runs: a web page can send these
    cross-site without a CORS preflight."""
    completion = json.dumps(NORMAL).encode()
    load = json.dumps({"lora_name": "new", "lora_path": str(lora_root / "d")}).encode()
    unload = json.dumps({"lora_name": "s"}).encode()
    before = metrics(server)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         None, "application/jsonx", "text/json"):
        for path, raw in (("/v1/completions", completion), ("/v1/chat/completions", completion),
                          ("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", unload)):
            assert_error(call(server, path, raw=raw, content_type=content_type), 415, "unsupported_media_type")
    after = metrics(server)
    tokens = ("hf_invisiblelora_prompt_tokens_total", ())
    assert after[tokens] == before[tokens] and adapter_ids(client) == [BASE_ID, "s", "b", "c"]
    reply = call(server, "/v1/completions", raw=completion, content_type="Application/JSON; charset=utf-8")
    assert reply.status == 200 and reply.body["choices"][0]["text"] == client.completions.create(**NORMAL).choices[0].text
    serves()


def test_bad_bodies_are_400_and_harm_nothing(server, client, serves):
    deep = b'{"prompt": "x", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep_enough = b'{"prompt": "x", "stop": ' + b"[" * 40 + b"]" * 40 + b"}"  # which json.loads takes
    digits = "9" * 5000
    cases = [
        ("/v1/completions", deep, "invalid_json"),
        ("/v1/chat/completions", deep, "invalid_json"),
        ("/v1/completions", deep_enough, "invalid_json"),
        ("/v1/completions", f'{{"prompt": "x", "seed": {digits}}}'.encode(), "invalid_value"),
        ("/v1/completions", f'{{"prompt": "x", "max_tokens": -{digits}}}'.encode(), "invalid_value"),
        ("/v1/completions", f'{{"prompt": [{digits}]}}'.encode(), "invalid_value"),
        ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}', "invalid_value"),
        ("/v1/completions", b'{"prompt": "a\\udfffb", "max_tokens": 4}', "invalid_value"),
        ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "invalid_value"),
        ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "invalid_value"),
        ("/v1/completions", b'{"prompt": "x", "\\ud800": 1}', "invalid_value"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_value"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
         "invalid_value"),
        ("/v1/chat/completions", b'{"model": "\\udbff", "messages": [{"role": "user", "content": "x"}]}',
         "invalid_value"),
        ("/v1/load_lora_adapter", b'{"lora_name": "\\ud800", "lora_path": "d"}', "invalid_value"),
        ("/v1/load_lora_adapter", b'{"lora_name": "n", "lora_path": "\\ud800"}', "invalid_value"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 4', "invalid_json"),
        ("/v1/completions", b"\xff\xfe\x00", "invalid_json"),
        ("/v1/completions", b'"just a string"', "invalid_json"),
    ]
    for path, raw, code in cases:
        assert_error(call(server, path, raw=raw), 400, code)
        serves()
    # Integers within the digit limit but past what the engine takes: refused by their ranges.
    for field, value, code in (("max_tokens", 10**19, "context_length_exceeded"), ("seed", 9 * 10**19, "invalid_value"),
                               ("top_k", -(10**19), "invalid_value")):
        assert_error(call(server, "/v1/completions", {**NORMAL, field: value}), 400, code)
        serves()
    assert call(server, "/v1/completions", {**NORMAL, "temperature": 10**19}).status == 200  # uniform sampling
    assert get_health(server)["in_flight"] == 0


def get_health(url) -> dict:
    reply = call(url, "/health", key=None)
    assert reply.status == 200
    return reply.body


def test_body_size_limit(server, client, serves):
    big = json.dumps({"model": "s", "prompt": "a" * BODY_LIMIT}).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"):
        assert_error(declared_too_large(server, path, BODY_LIMIT + 1), 413, "request_too_large")
        assert_error(call(server, path, raw=big, chunked=True), 413, "request_too_large")  # counted as it comes
        serves()
    just = json.dumps({**NORMAL, "user": "u" * (BODY_LIMIT - 200)}).encode()  # a field the server ignores
    reply = call(server, "/v1/completions", raw=just)
    assert len(just) <= BODY_LIMIT and reply.status == 200
    assert reply.body["choices"][0]["text"] == client.completions.create(**NORMAL).choices[0].text


def test_tiny_temperature_decodes_as_greedy(client, serves):
    """temperature 1e-40 overflowed float32 in the sampler (an empty 12-token answer); below 1e-5
    a request decodes greedily, as the limit of sampling at temperature -> 0."""
    for model, prompt in (("s", TEXTS[1]), (BASE_ID, TEXTS[2]), ("b", TEXTS[3])):
        greedy = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        for temperature in (1e-40, 5e-324, 1e-6):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=temperature, seed=3,
                                          top_p=0.9, extra_body={"top_k": 5})
            assert r.choices[0].text == greedy.choices[0].text and r.usage == greedy.usage
        streamed = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=1e-40, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == greedy.choices[0].text
    serves()


def test_oversized_prompts_are_refused_before_tokenizing(server, client, serves):
    """Eight 1 MB prompts at once (completions and chat; tokenizing one took seconds and hundreds of
    MB): each is refused (400 context_length_exceeded) before it is tokenized, /health and a small
    request beside them answer at once, and the server's memory does not grow."""
    text = ("the quick brown fox " * (ONE_MB // 20 + 1))[:ONE_MB]
    bodies = [("/v1/completions", {"model": "s", "prompt": text, "max_tokens": 4}),
              ("/v1/chat/completions", {"model": "b", "messages": [{"role": "user", "content": text}]})] * 4
    wait_idle(server)
    before = rss(server)
    with ThreadPoolExecutor(len(bodies)) as pool:
        start = time.perf_counter()
        replies = [pool.submit(call, server, path, body) for path, body in bodies]
        small = call(server, "/v1/completions", NORMAL)
        small_s = time.perf_counter() - start
        health = call(server, "/health", key=None)
        for reply in replies:
            assert_error(reply.result(), 400, "context_length_exceeded")
        refused_s = time.perf_counter() - start
    assert small.status == 200 and health.status == 200
    # Tokenized, the eight took 8-36 s and held the small request as long; parsing 8 MB of JSON takes well under 1 s.
    assert small_s < 5 and refused_s < 10, (small_s, refused_s)
    assert rss(server) - before < 64 * 2**20, (before, rss(server))
    serves()


def test_clients_vanishing_mid_stream(server, client, serves, endless):
    """Streams whose clients drop the connection after a few events, and calls that time out: the
    server frees their rows, holds nothing afterwards and answers correctly."""
    before = wait_idle(server)

    def vanish(count: int):
        conn, r = open_stream(server, {"model": "s", "prompt": endless, "max_tokens": 900, "temperature": 0})
        seen = [json.loads(e) for e in events(r, count)]
        conn.sock.close()  # gone, without a word
        return seen

    def time_out():
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=0.5).completions.create(model="s", prompt=endless, max_tokens=900,
                                                                temperature=0)

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(vanish, n) for n in (1, 2, 3, 5)]
        calls = [pool.submit(time_out) for _ in range(2)]
        for f in streams:
            assert all(e["object"] == "text_completion" for e in f.result())
        [f.result() for f in calls]
    after = wait_idle(server)
    cancelled = ("hf_invisiblelora_requests_finished_total", (("finish_reason", "cancelled"),))
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == 6
    assert get_health(server)["in_flight"] == 0
    serves()


# --- a server with its key from the environment and no runtime loading; then SIGTERM ---


def test_defaults_then_sigterm_under_load(files, tmp_path, endless, endless_seconds):
    """No --allow-runtime-lora-updating: the loading routes are 404 and change nothing. Then
    SIGTERM with requests in flight: new requests get 503 while a short stream finishes; the
    streams and the waiting call still running at --shutdown-timeout end with an error event and
    [DONE] (the call with 503); no 500 anywhere; the process exits in time, with 0. The timeout is
    a third of what the endless requests take alone here (at most 3 s), so on a fast machine too
    they are still running at it, while the short stream's SHORT_TOKENS take a fraction of it."""
    log, timeout = tmp_path / "server.log", round(max(0.3, min(3.0, endless_seconds / 3)), 2)
    with launch(files, log, "--shutdown-timeout", str(timeout),
                env={API_KEY_ENV: KEY, RUNTIME_LORA_ENV: "0"}) as (url, proc):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert_error(call(url, "/v1/models", key=None), 401, "invalid_api_key")
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(files / "spare" / "d")}),
                           ("/v1/unload_lora_adapter", {"lora_name": "b"})):
            assert "--allow-runtime-lora-updating" in assert_error(call(url, path, body), 404, "not_found")["message"]
        assert adapter_ids(client) == [BASE_ID, "s", "b", "c"]

        short = dict(model="b", prompt=TEXTS[4], max_tokens=SHORT_TOKENS, temperature=0)
        expected = client.completions.create(**short).choices[0].text
        endless_body = {"model": "s", "prompt": endless, "max_tokens": 900, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(call, url, "/v1/completions", endless_body)
            streams = [open_stream(url, endless_body) for _ in range(2)]
            firsts = [events(r, 1) for _, r in streams]  # each holds a row now
            deadline = time.monotonic() + 20
            while get_health(url)["in_flight"] < 3:  # and so does the waiting call
                assert time.monotonic() < deadline
                time.sleep(0.02)
            streams.append(open_stream(url, short))
            firsts.append(events(streams[-1][1], 1))  # in flight, with SHORT_TOKENS to go
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            while call(url, "/health", key=None).status == 200:
                time.sleep(0.01)
            fresh = call(url, "/v1/completions", short)  # a new request while draining
            assert_error(fresh, 503, "server_shutting_down")
            assert fresh.headers["Connection"] == "close"
            ends = [first + events(r) for first, (_, r) in zip(firsts, streams)]
            assert_error(waiting.result(timeout=30), 503, "server_shutting_down")
        for conn, _ in streams:
            conn.close()
        *cut, finished = ends
        assert all(e[-1] == "[DONE]" for e in ends)
        text = "".join(json.loads(e)["choices"][0]["text"] for e in finished[:-1])
        assert text == expected and json.loads(finished[-2])["choices"][0]["finish_reason"] == "length"
        for stream in cut:  # still running at the deadline: an error event, then [DONE]
            error = json.loads(stream[-2])["error"]
            assert error["code"] == "server_shutting_down" and "choices" in json.loads(stream[-3])
            assert_clean(stream[-2])
        assert proc.wait(timeout + 15) == 0
        assert time.monotonic() - sent < timeout + 10
    output = log.read_text()
    assert "Traceback" not in output and "ERROR" not in output, output[-3000:]


# --- in process: failures injected where no request can cause them ---


@pytest.fixture
def app_client():
    """The app on an engine of its own (tiny model, adapter s; a chat template that refuses role
    "bad" with a message naming a secret path), through Starlette's TestClient."""
    from starlette.testclient import TestClient

    from hf_invisiblelora.engine import Engine
    from hf_invisiblelora.serving.app import Server, build_app
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('secret "
                               "/opt/secret/path.py') }}{% endif %}" + CHAT_TEMPLATE[len("{% for m in messages %}"):])
    engine = Engine(tiny_peft("llama", adapters=("s",), dtype=torch.float32), max_batch=2, max_len=128,
                    num_draft_tokens=2).start()
    server = Server(engine, tokenizer, BASE_ID, "/models/tiny")
    try:
        yield TestClient(build_app(server), raise_server_exceptions=False), server
    finally:
        engine.stop()


def test_failures_inside_say_internal_error_with_a_request_id(app_client, monkeypatch):
    from hf_invisiblelora.decode.decoder import Decoder
    from hf_invisiblelora.serving.text import TextStream

    client, server = app_client
    body = {"model": "s", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
    normal = client.post("/v1/completions", json=body).json()["choices"][0]["text"]

    def boom(*args, **kwargs):
        raise RuntimeError("secret /opt/secret/path.py")

    def stream_events(r):
        return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]

    def check(reply, status, code):  # a 500: its message names the request id of its header
        error = assert_error(Reply(reply.status_code, reply.headers, reply.json()), status, code, "/opt/secret")
        assert reply.headers["X-Request-Id"] in error["message"]

    # The server itself fails: 500 internal_error, counted.
    monkeypatch.setattr(server, "models", boom)
    check(client.get("/v1/models"), 500, "internal_error")
    assert ('hf_invisiblelora_http_requests_total{endpoint="/v1/models",status="500"} 1.0'
            in client.get("/metrics").text)
    # The engine fails in a decoder cycle: 500 engine_error; a stream's error event, then [DONE].
    monkeypatch.setattr(Decoder, "cycle", boom)
    check(client.post("/v1/completions", json=body), 500, "engine_error")
    events = stream_events(client.post("/v1/completions", json={**body, "stream": True}))
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"
    assert_clean(events[-2], "/opt/secret")
    monkeypatch.undo()
    # Detokenizing fails mid-stream: an internal_error event, then [DONE].
    monkeypatch.setattr(TextStream, "add", boom)
    events = stream_events(client.post("/v1/completions", json={**body, "stream": True}))
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
    assert_clean(events[-2], "/opt/secret")
    monkeypatch.undo()
    # The chat template refuses the messages: a 400 in our words, not the template's.
    reply = client.post("/v1/chat/completions", json={"model": "s", "messages": [{"role": "bad", "content": "x"}]})
    assert_error(Reply(reply.status_code, reply.headers, reply.json()), 400, "invalid_value", "/opt/secret")
    assert "secret" not in reply.text
    # The engine serves on, as before.
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == normal
    assert client.get("/health").json()["in_flight"] == 0


@pytest.mark.parametrize("args, says", [(["--api-key", " x"], "API key"), (["--api-key", ""], "API key"),
                                        (["--lora-root", "/no/such/root"], "--lora-root /no/such/root is not a folder")])
def test_bad_security_options_exit_2(files, capsys, args, says):
    """Refused before anything loads (in this process: main() returns or exits before the model loads)."""
    from hf_invisiblelora.serving.cli import main

    argv = ["--model", str(files / "base"), f"--lora=s={files / 'adapters' / 's'}", *args]
    with pytest.raises(SystemExit) if args[0] == "--api-key" else contextlib.nullcontext() as exited:
        code = main(argv)
    assert (exited.value.code if exited else code) == 2
    assert says in capsys.readouterr().err
