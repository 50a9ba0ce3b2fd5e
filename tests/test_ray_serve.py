"""Scale-out on Ray Serve (serving/ray_app.py) on a local Ray instance bound to 127.0.0.1: two
replicas of the engine on the tiny saved model of test_serve.py behind the OpenAI routes. Answers
equal standalone generate(); an adapter's repeated requests land on a replica that holds it; a
replica killed mid-request ends that request cleanly and the application serves on."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest
from test_serve import ADAPTERS, BASE_ID, MAX_LEN, TEXTS, files, free_port, generate, reference  # noqa: F401

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from hf_invisiblelora.serving.ray_app import REPLICA_HEADER, app_builder, server_argv  # noqa: E402


def post(url, body, timeout=60):
    """(status, headers, parsed JSON) of a POST."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


@pytest.fixture(scope="module")
def app(files, tmp_path_factory):
    """The application's base URL: two replicas (one CPU each), Serve's proxy on 127.0.0.1. Ray's
    workers start in the driver's folder, which must not be the source tree (its hf_invisiblelora/
    would shadow the installed package, which holds kernels/)."""
    port, cwd = free_port(), os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray_cwd"))
    ray.init(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": str(files / "base"), "lora": ",".join(f"{n}={files / 'adapters' / n}" for n in ADAPTERS),
                "served_model_name": BASE_ID, "max_batch": "4", "max_len": str(MAX_LEN), "num_draft_tokens": "2",
                "gate": "always", "log_level": "warning", "num_replicas": "2"}
        serve.run(app_builder(args), name="lora", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.chdir(cwd)


def test_the_keys_are_the_servers_options():
    """``key=value`` pairs (or a config's lists) become the server's command line; Ray's own keys
    are left out; what cannot hold under Ray, and unknown keys, are refused up front."""
    from hf_invisiblelora.serving import cli

    argv = server_argv({"model": "/m", "lora": "a=/x,b=/y", "draft_dtype": ["float32", "int8"], "max_batch": 4,
                        "num_replicas": "3", "lora_root": ["/r"]})
    assert argv == ["--model", "/m", "--lora", "a=/x", "--lora", "b=/y", "--draft-dtype", "float32", "int8",
                    "--max-batch", "4", "--lora-root", "/r"]
    for value, flag in (("false", "--no-enable-prefix-caching"), (True, "--enable-prefix-caching")):  # --x / --no-x
        assert server_argv({"model": "/m", "enable_prefix_caching": value}) == ["--model", "/m", flag]
        assert cli.parse(server_argv({"model": "/m", "enable_prefix_caching": value})).enable_prefix_caching == \
            (flag == "--enable-prefix-caching")
    for bad, word in (({"host": "0.0.0.0"}, "http_options"), ({"allow_runtime_lora_updating": "true"}, "one replica"),
                      ({"max_batchh": "4"}, "unknown key")):
        with pytest.raises(ValueError, match=word):
            server_argv(bad)


def test_answers_equal_generate(app, reference):
    """Mixed adapters and the base model, token-id and text prompts: each answer equals standalone
    generate() of the same saved files."""
    tok = reference[1]
    for i, model in enumerate([*ADAPTERS, BASE_ID] * 2):
        prompt = TEXTS[i % len(TEXTS)]
        ids = tok(prompt)["input_ids"]
        tokens, text = generate(reference, ids, model, 6 + i)
        status, headers, body = post(app, {"model": model, "prompt": prompt, "max_tokens": 6 + i, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == len(tokens)
        assert headers[REPLICA_HEADER]
    status, _, body = post(app, {"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"  # the replica's own answer


def test_an_adapters_requests_stay_on_a_replica_that_holds_it(app):
    """After its first request, every request for an adapter goes to a replica that registered it
    with Ray Serve's multiplexing (Ray Serve learns that asynchronously: the first few may go elsewhere)."""
    for model in ADAPTERS[:2]:
        seen = []
        for i in range(10):
            status, headers, body = post(app, {"model": model, "prompt": TEXTS[i % 3], "max_tokens": 2})
            assert status == 200, body
            seen.append(headers[REPLICA_HEADER])
            time.sleep(0.2)
        assert len(set(seen[4:])) == 1 and seen[4] in seen[:4], seen


def test_a_replica_that_dies_mid_request_fails_it_cleanly(app, reference):
    """A stream whose replica is killed ends with an error event and [DONE] (no hang); then the
    application answers again (the other replica, and the one Ray Serve starts anew), exactly."""
    body = {"model": "s", "prompt": TEXTS[0], "max_tokens": MAX_LEN - 40, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(app + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        replica = r.headers[REPLICA_HEADER]
        first = r.readline()
        assert first.startswith(b"data: ")
        [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if replica in a["name"]]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        lines = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "replica_failed"
    tok = reference[1]
    ids = tok(TEXTS[1])["input_ids"]
    want = {m: generate(reference, ids, m, 5)[1] for m in ADAPTERS}
    answered, deadline = 0, time.monotonic() + 60
    while answered < 6:
        assert time.monotonic() < deadline, "the application did not serve again after a replica died"
        model = ADAPTERS[answered % 3]
        status, _, out = post(app, {"model": model, "prompt": TEXTS[1], "max_tokens": 5, "temperature": 0})
        if status == 503:  # routed to the dead replica before Ray Serve saw it die: a clean refusal
            assert out["error"]["code"] == "replica_failed"
            time.sleep(0.5)
            continue
        assert status == 200 and out["choices"][0]["text"] == want[model], out
        answered += 1


def test_the_example_config_is_a_serve_config_of_this_app():
    """examples/ray_serve.yaml: a valid Ray Serve config whose application is app_builder with
    arguments the server takes."""
    import importlib
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from hf_invisiblelora.serving import cli

    config = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "ray_serve.yaml").read_text())
    [application] = ServeDeploySchema(**config).applications
    module, _, name = application.import_path.partition(":")
    assert getattr(importlib.import_module(module), name) is app_builder
    assert cli.parse(server_argv(application.args)).zoo == "smollm2"


def test_bad_requests_get_error_objects(app):
    """The router refuses an oversized body (413) without forwarding it, answers unknown routes in the
    API's error shape, and passes what the replica's server refuses through (415: not JSON)."""
    status, _, body = post(app, {"model": "s", "prompt": "x" * (5 * 2**20), "max_tokens": 2})
    assert status == 413 and body["error"]["code"] == "body_too_large"
    for path, data, ctype, want in (("/nope", None, None, 404), ("/v1/completions", b"model=s", "text/plain", 415)):
        req = urllib.request.Request(app + path, data=data, headers={"Content-Type": ctype} if ctype else {})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == want
        error = json.loads(e.value.read())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
