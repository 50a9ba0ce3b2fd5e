"""The OpenAI / vLLM request parameters on a subprocess server (test_serve.py's tiny model, its
fixtures and helpers): each honoured parameter against a reference computed in this process from
the same saved files (standalone generate() with the matching Transformers option, or the model's
own logits for logprobs), and every other field refused with a 400 naming it."""

from __future__ import annotations

import openai
import pytest
import torch
from test_serve import (BASE_ID, TEXTS, assert_error, client, files, launch, reference, request,  # noqa: F401
                        server, wait_idle)


def greedy(reference, ids, adapter, max_tokens, **kw):
    """Standalone greedy generate(): the new tokens up to the first stop token (kept)."""
    model, tok = reference
    stops = kw.pop("eos_token_id", [tok.eos_token_id])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), adapter_names=[adapter], max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=stops, **kw)
    new = out[0, len(ids):].tolist()
    first = next((i for i, t in enumerate(new) if t in stops), None)
    return new if first is None else new[: first + 1]


def prompt_with_eos(reference, adapter="s", max_tokens=20):
    """Token ids whose greedy output has EOS at position >= 3 (searched in this process; greedy is deterministic)."""
    model, tok = reference
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        ids = torch.randint(2, 64, (4,), generator=g).tolist()
        free = greedy(reference, ids, adapter, max_tokens, eos_token_id=[])
        if tok.eos_token_id in free[3:] and free.index(tok.eos_token_id) >= 3:
            return ids, free
    pytest.skip("no prompt with a late EOS found")


def text_of(reference, tokens):
    return reference[1].decode(tokens, skip_special_tokens=True)


def test_stop_token_ids_min_tokens_ignore_eos_repetition_penalty(client, reference):
    ids, free = prompt_with_eos(reference)
    eos = reference[1].eos_token_id
    at = free.index(eos)
    kw = dict(model="s", prompt=ids, max_tokens=20, temperature=0)
    r = client.completions.create(**kw)  # the reference: stops at EOS
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == at + 1
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    assert r.choices[0].text == text_of(reference, free)
    stop = free[1]  # a stop token id before EOS
    for include in (False, True):
        r = client.completions.create(**kw, extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": include})
        kept = free[: free.index(stop) + 1]
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(kept)
        assert r.choices[0].text == text_of(reference, kept if include else kept[:-1])  # its text only if asked
    r = client.completions.create(**kw, extra_body={"min_tokens": at + 2})
    expected = greedy(reference, ids, "s", 20, min_new_tokens=at + 2)
    assert expected != free[: at + 1] and r.usage.completion_tokens == len(expected)
    assert r.choices[0].text == text_of(reference, expected)
    for penalty in (1.8, 0.6):
        r = client.completions.create(**kw, extra_body={"repetition_penalty": penalty, "ignore_eos": True})
        expected = greedy(reference, ids, "s", 20, repetition_penalty=penalty, eos_token_id=[])
        assert r.choices[0].text == text_of(reference, expected)
    assert greedy(reference, ids, "s", 20, repetition_penalty=1.8, eos_token_id=[]) != free  # the option matters


def reference_logprobs(reference, ids, adapter, tokens):
    """log-softmax of the model's own logits at each output position (float32, LoRA on)."""
    model, _ = reference
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens]), adapter_names=[adapter]).logits[0]
    return logits[len(ids) - 1 : len(ids) - 1 + len(tokens)].float().log_softmax(-1)


def test_logprobs_are_the_models_own(client, reference):
    """Completions' logprobs=3 (tokens named by id, vLLM's return_tokens_as_token_ids) against the
    model's own log-softmax at each output position, greedy and sampled (raw logprobs: temperature
    does not change them)."""
    tok = reference[1]
    ids = tok(TEXTS[2])["input_ids"]
    for temperature, seed in ((0, None), (0.9, 3)):
        r = client.completions.create(model="b", prompt=ids, max_tokens=10, temperature=temperature, seed=seed,
                                      logprobs=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
        tokens = [int(t.removeprefix("token_id:")) for t in lp.tokens]
        assert text_of(reference, tokens) == r.choices[0].text
        ref = reference_logprobs(reference, ids, "b", tokens)
        chosen = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(lp.token_logprobs), chosen, atol=1e-4)
        for j, top in enumerate(lp.top_logprobs):
            best = ref[j].topk(3)
            want = {f"token_id:{i}": v for i, v in zip(best.indices.tolist(), best.values.tolist())}
            want[lp.tokens[j]] = float(chosen[j])  # the chosen token's too (OpenAI: up to logprobs + 1)
            assert top.keys() == want.keys() and all(abs(top[k] - want[k]) < 1e-4 for k in want)
        if temperature == 0:
            assert tokens == greedy(reference, ids, "b", 10, eos_token_id=[])
    plain = client.completions.create(model="b", prompt=ids, max_tokens=6, temperature=0, logprobs=0).choices[0]
    assert all(len(top) == 1 for top in plain.logprobs.top_logprobs)
    assert plain.logprobs.text_offset == [sum(len(t) for t in plain.logprobs.tokens[:j]) for j in range(6)]
    messages = [{"role": "user", "content": "hello world"}]
    kw = dict(model="s", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # greedy: the chosen one is the best
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    streamed = [c for chunk in client.chat.completions.create(**kw, stream=True) for choice in chunk.choices
                if choice.logprobs for c in choice.logprobs.content]
    # the same tokens; log-probabilities to float rounding (each comes from the pass that chose its token)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    r = client.chat.completions.create(model="s", messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_n_choices(client):
    kw = dict(model="c", prompt=TEXTS[3], max_tokens=8, temperature=1.0, seed=11)
    r = client.completions.create(**kw, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(**{**kw, "seed": 11 + i}).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone and len(set(alone)) > 1  # choice i samples with seed + i
    singles = [client.completions.create(**{**kw, "seed": 11 + i}).usage for i in range(3)]
    assert r.usage.completion_tokens == sum(u.completion_tokens for u in singles)
    assert r.usage.prompt_tokens == singles[0].prompt_tokens  # the prompt counted once
    chunks = list(client.completions.create(**kw, n=3, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(ch.text for c in chunks for ch in c.choices if ch.index == i) for i in range(3)]
    assert texts == alone and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    greedy_two = client.chat.completions.create(model="s", messages=[{"role": "user", "content": "hi"}], n=2,
                                                max_tokens=6, temperature=0)
    assert greedy_two.choices[0].message.content == greedy_two.choices[1].message.content


def test_echo_and_chat_continuation(client, reference):
    r = client.completions.create(model="s", prompt=TEXTS[0], max_tokens=5, temperature=0)
    echoed = client.completions.create(model="s", prompt=TEXTS[0], max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == TEXTS[0] + r.choices[0].text
    chunks = client.completions.create(model="s", prompt=TEXTS[0], max_tokens=5, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    model, tok = reference
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the quick"}]
    r = client.chat.completions.create(model="b", messages=messages, max_tokens=6, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "echo": True})
    text = tok.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    expected = greedy(reference, ids, "b", 6)
    assert r.choices[0].message.content == "the quick" + text_of(reference, expected)
    with pytest.raises(openai.BadRequestError) as e:  # both at once is contradictory
        client.chat.completions.create(model="b", messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert_error(e.value, 400)


def test_stop_strings_with_min_tokens_and_include(client, reference):
    kw = dict(model="s", prompt=TEXTS[1], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    piece = next(full[i:i + 2] for i in range(1, len(full) - 2) if full[i:i + 2].strip() and len(full[i:i + 2]) == 2)
    cut = full.find(piece)
    r = client.completions.create(**kw, stop=[piece])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    body = {**kw["extra_body"], "include_stop_str_in_output": True}
    r = client.completions.create(**{**kw, "extra_body": body}, stop=[piece])
    assert r.choices[0].text == full[: cut + len(piece)]
    chunks = client.completions.create(**{**kw, "extra_body": body}, stop=[piece], stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[: cut + len(piece)]
    # min_tokens: a stop string that ends within the first min_tokens - 1 tokens does not count (vLLM's rule)
    stopped = client.completions.create(**kw, stop=[piece]).usage.completion_tokens  # the one completing it
    floor = len(client.completions.create(**{**kw, "max_tokens": stopped}).choices[0].text)
    assert floor >= cut + len(piece)
    again = full.find(piece, floor - len(piece) + 1)
    r = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "min_tokens": stopped + 1}}, stop=[piece])
    assert r.choices[0].text == (full[:again] if again >= 0 else full)
    assert r.choices[0].finish_reason == ("stop" if again >= 0 else "length")


def test_max_tokens_zero_as_vllm(server, client, reference):
    """max_tokens 0 is vLLM's: a completion with echo is the prompt only (echo_without_generation),
    streamed or not, its log-probabilities with logprobs; without echo, and on a chat (max_tokens
    or max_completion_tokens, echo or not), a 400 naming the field, as vLLM's SamplingParams
    refuses max_tokens < 1."""
    ids = reference[1](TEXTS[0])["input_ids"]
    r = client.completions.create(model="s", prompt=TEXTS[0], max_tokens=0, echo=True, logprobs=1)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (TEXTS[0], "length", 0)
    assert len(r.choices[0].logprobs.tokens) == len(ids) and r.choices[0].logprobs.token_logprobs[0] is None
    chunks = list(client.completions.create(model="s", prompt=TEXTS[0], max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXTS[0]
    messages = [{"role": "user", "content": "hi"}]
    for path, body, field in [
            ("/v1/completions", {"prompt": TEXTS[0], "max_tokens": 0}, "max_tokens"),
            ("/v1/completions", {"prompt": ids, "max_tokens": 0, "prompt_logprobs": 1}, "max_tokens"),
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 0}, "max_tokens"),
            ("/v1/chat/completions", {"messages": messages, "max_completion_tokens": 0}, "max_completion_tokens"),
            ("/v1/chat/completions", {"messages": messages, "max_completion_tokens": 0, "max_tokens": 5},
             "max_completion_tokens"),
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 0, "echo": True}, "max_tokens")]:
        status, reply = request(server, path, {"model": "s", **body})
        assert status == 400, (body, reply)
        assert reply["error"]["param"] == field and "at least 1, got 0" in reply["error"]["message"], reply


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model="b", prompt=TEXTS[4], max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.total_tokens - chunks[-1].usage.prompt_tokens
    assert len(set(counts)) > 1  # it counts as it goes


@pytest.mark.parametrize("field, value", [
    ("prompt_logprobs", 21), ("use_beam_search", True), ("truncate_prompt_tokens", 4), ("return_token_ids", True),
    ("structured_outputs", {"json": {}, "regex": "a+"}), ("guided_json", 5), ("guided_regex", "[a-"),
    ("guided_choice", []), ("response_format", {"type": "xml"}), ("best_of", 2), ("suffix", "x"),
    ("presence_penalty", 2.5), ("frequency_penalty", "x"), ("logit_bias", {"3": 500}), ("skip_special_tokens", False),
    ("made_up_field", 1), ("min_p", 2), ("repetition_penalty", 0), ("min_tokens", 9), ("stop_token_ids", [64]),
    ("stop_token_ids", "x"), ("ignore_eos", "yes"), ("stream_options", {"include_usage": True}),
])
def test_every_other_field_is_refused_by_name(server, field, value):
    body = {"model": "s", "prompt": "hello", "max_tokens": 4, field: value}
    status, reply = request(server, "/v1/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == field and error["message"]


@pytest.mark.parametrize("field, value", [
    ("echo", True), ("continue_final_message", True), ("top_logprobs", 2), ("made_up_field", None),
    ("guided_choice", "a"), ("response_format", {"type": "json_schema", "json_schema": {}})])
def test_chat_fields_refused_by_name(server, field, value):
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "s", "messages": messages, "max_tokens": 2, field: value}
    if field == "echo":  # chat echo is honoured
        status, reply = request(server, "/v1/chat/completions", body)
        assert status == 200 and reply["choices"][0]["message"]["content"] is not None
        return
    status, reply = request(server, "/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] in (field, "continue_final_message"), reply


def test_neutral_values_are_accepted(server):
    body = {"model": "s", "prompt": "hello", "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "best_of": 1, "suffix": "", "use_beam_search": False, "user": "someone",
            "skip_special_tokens": True, "prompt_logprobs": None, "logprobs": None, "n": 1}
    status, reply = request(server, "/v1/completions", body)
    assert status == 200, reply
    assert wait_idle(server)


def test_max_cpu_loras_serves_every_adapter(files, reference, tmp_path):
    """--max-cpu-loras 1 --max-loras 1: three adapters take turns in the model (evicted, loaded again), each as generate()."""
    tok = reference[1]
    with launch(files, tmp_path / "server.log", "--max-cpu-loras", "1", "--max-loras", "1") as (url, _):
        bounded = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in bounded.models.list().data] == [BASE_ID, "s", "b", "c"]
        ids = tok(TEXTS[5])["input_ids"]
        for adapter in ("c", "s", "b", "c"):
            r = bounded.completions.create(model=adapter, prompt=ids, max_tokens=6, temperature=0)
            assert r.choices[0].text == text_of(reference, greedy(reference, ids, adapter, 6))
        status, text = request(url, "/metrics")
        loads = [line for line in text.splitlines() if line.startswith("hf_invisiblelora_adapter_loads")]
        assert loads and float(loads[0].split()[-1]) >= 3
