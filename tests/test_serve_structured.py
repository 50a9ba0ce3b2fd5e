"""Structured outputs and tools over HTTP (serving/structured.py) on a subprocess server: a tiny
random Llama (vocabulary 320) with tiny.json_tokenizer, a byte-level BPE that can spell JSON, and a
Hermes / Qwen2.5-style chat template with a tools section.

Exactness: every constrained greedy answer (response_format, structured_outputs, guided_*, tool_choice
required / named, and auto's text) equals stock PEFT generate() with xgrammar's Transformers
logits processor over the same grammar (compiled by an xgrammar GrammarCompiler of this process:
decode.grammar.compile_spec, the server's options), streamed or not, alone or in a mixed batch.
Validity: answers that finish are valid under their schema (jsonschema). The tiny model rarely
closes JSON on its own, so requests send a logit_bias towards the tokens that hold ", } or ].
Also: the Hermes tool-call parser and the streamed tool-call deltas on strings; the openai client's
parse() and a tool-call loop; bad input (each a 400 naming its field, no traceback), a grammar that
takes too long to compile; tools served on a template without a tool format (SmolLM2's ChatML);
slow grammars queued apart (a plain request served meanwhile, past the queue a 429, a refusal
remembered) and the compiling process killed (the requests served).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest
import torch
import xgrammar as xgr
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList
from xgrammar.contrib.hf import LogitsProcessor as XgrammarProcessor

from hf_invisiblelora.serving.grammars import GrammarSpec, compile_spec
from hf_invisiblelora.serving.tool_calls import ToolCalls, parse_hermes, parse_required
from test_serve import ADAPTERS, BASE_ID, launch, request
from tiny import json_tokenizer, tiny_peft

VOCAB = 320
EOS = 1
COMPILE_TIMEOUT = 1.5  # --grammar-compile-timeout of the test server: slow_grammar takes ~7 s, the others < 0.3
MAX_TOKENS = 80

# A Hermes / Qwen2.5-style template, short: the tools as JSON inside <tools></tools>, tool calls as
# <tool_call>{"name", "arguments"}</tool_call>, tool results as <tool_response> turns.
HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:\n<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}</tools>\n"
    "Call one with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|tool|><tool_response>{{ m.content }}</tool_response>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content }}"
    "{%- for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}</tool_call>{%- endfor %}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "oslo", "rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"]}}}
NOTE = {"type": "function", "function": {"name": "note"}}  # no parameters: any object
TOOLS = [WEATHER, ADD, NOTE]
# vLLM's weather-tool examples' shape: parameters that refer to their own $defs (one shared by both tools)
UNIT = {"type": "string", "enum": ["c", "f"]}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"], "$defs": {"City": {"type": "string", "enum": ["paris", "oslo"]}, "Unit": UNIT}}}}
CONVERT = {"type": "function", "function": {"name": "convert", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Unit"}, "value": DIGIT}, "required": ["to", "value"],
    "$defs": {"Unit": UNIT}}}}
DEFS_TOOLS = [FORECAST, CONVERT]
PROMPTS = ["the quick brown fox", '{"name": "ada"', "[1, 2, 3"]
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+ | "none"'


# --- the server and the reference ---


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """test_serve.launch's layout: a tiny float32 Llama of vocabulary 320 in base/ with the JSON
    tokenizer and the Hermes template, adapters s, b, c in adapters/."""
    root = tmp_path_factory.mktemp("serve_structured")
    model = tiny_peft("llama", vocab=VOCAB, adapters=ADAPTERS, strength=0.6, dtype=torch.float32)
    model.save_pretrained(root / "adapters")
    model.unload().save_pretrained(root / "base")
    tok = json_tokenizer(VOCAB)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(root / "base")
    return root


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_structured_log") / "server.log"
    with launch(files, log, "--grammar-compile-timeout", str(COMPILE_TIMEOUT)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


class Reference:
    """Stock PEFT (no invisible_lora) on the saved files, and an xgrammar compiler for its tokenizer."""

    def __init__(self, files):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(files / "base"),
                                          files / "adapters" / "s", adapter_name="s")
        for name in ADAPTERS[1:]:
            model.load_adapter(files / "adapters" / name, adapter_name=name)
        self.model = model.eval()
        self.tok = AutoTokenizer.from_pretrained(files / "base")
        info = xgr.TokenizerInfo.from_huggingface(self.tok, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(info)
        self.closing = {i: 3.0 for i in range(VOCAB) if any(c in self.tok.decode([i]) for c in '"}]')}

    def bias(self) -> dict:
        return {str(i): v for i, v in self.closing.items()}

    def chat_ids(self, messages, tools=None) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def generate(self, ids, adapter, spec: GrammarSpec | None, max_tokens=MAX_TOKENS, bias=True):
        """Stock greedy generate() under ``spec`` (xgrammar's processor): (tokens up to EOS, text, finish_reason)."""
        processors = []
        if spec is not None:
            processors.append(XgrammarProcessor(compile_spec(self.compiler, spec.key())))
        if bias:
            processors.append(Bias(self.closing))
        adapter = "__base__" if adapter == BASE_ID else adapter
        with torch.no_grad():
            out = self.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                                      adapter_names=[adapter], max_new_tokens=max_tokens, do_sample=False,
                                      logits_processor=LogitsProcessorList(processors), eos_token_id=[EOS],
                                      pad_token_id=0)
        new = out[0, len(ids):].tolist()
        if EOS in new:
            new = new[: new.index(EOS) + 1]
        reason = "stop" if new and new[-1] == EOS else "length"
        return new, self.tok.decode(new, skip_special_tokens=True), reason


class Bias(LogitsProcessor):
    def __init__(self, bias: dict):
        self.ids, self.values = torch.tensor(list(bias)), torch.tensor(list(bias.values()))

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.ids] += self.values.to(scores.dtype)
        return scores


@pytest.fixture(scope="module")
def ref(files):
    return Reference(files)


def post(server, path, body):
    status, reply = request(server, path, body)
    assert status == 200, reply
    return reply


def complete(server, ref, adapter, prompt, extra, chat=False, stream=False, bias=True, max_tokens=MAX_TOKENS):
    """One greedy request over HTTP: (text or the message, finish_reason, completion_tokens)."""
    body = {"model": adapter, "max_tokens": max_tokens, "temperature": 0, **extra}
    if bias:
        body["logit_bias"] = ref.bias()
    if chat:
        body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        reply = post(server, path, body)
        choice = reply["choices"][0]
        return (choice["message"] if chat else choice["text"]), choice["finish_reason"], \
            reply["usage"]["completion_tokens"]
    body["stream"], body["stream_options"] = True, {"include_usage": True}
    events = stream_events(server, path, body)
    usage = events[-1]["usage"]
    choices = [e["choices"][0] for e in events if e["choices"]]
    reason = choices[-1]["finish_reason"]
    assert all(c["finish_reason"] is None for c in choices[:-1])
    if not chat:
        return "".join(c["text"] for c in choices), reason, usage["completion_tokens"]
    return assemble([c["delta"] for c in choices]), reason, usage["completion_tokens"]


def stream_events(server, path, body) -> list:
    import urllib.request

    req = urllib.request.Request(server + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = r.read().decode().splitlines()
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]", lines[-3:]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert not any("error" in e for e in events), events
    return events


def assemble(deltas: list) -> dict:
    """A chat message from its chunks' deltas, as a client joins them (content pieces, tool calls by index)."""
    message = {"role": None, "content": None}
    calls = {}
    for d in deltas:
        if "role" in d:
            message["role"] = d["role"]
        if d.get("content") is not None:
            message["content"] = (message["content"] or "") + d["content"]
        for tc in d.get("tool_calls") or ():
            call = calls.setdefault(tc["index"], {"id": None, "type": None, "function": {"name": None,
                                                                                        "arguments": ""}})
            call["id"] = tc.get("id") or call["id"]
            call["type"] = tc.get("type") or call["type"]
            call["function"]["name"] = tc.get("function", {}).get("name") or call["function"]["name"]
            call["function"]["arguments"] += tc.get("function", {}).get("arguments") or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def without_ids(message: dict) -> dict:
    """A message with its tool calls' random ids dropped (two answers' ids differ; they are checked apart)."""
    out = dict(message)
    if out.get("tool_calls"):
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in out["tool_calls"])
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in out["tool_calls"]]
    return out


# --- exactness against stock generate() ---


def test_json_schema_equals_stock_generate(server, ref):
    """response_format json_schema, completions and chat, streamed and not: stock's tokens under the
    schema; answers that finish are valid."""
    spec = GrammarSpec("json_schema", PERSON)
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}}}
    finished = 0
    for adapter in ("s", "b", BASE_ID):
        for k, prompt in enumerate(PROMPTS[:2]):
            ids = ref.tok(prompt)["input_ids"]
            tokens, text, reason = ref.generate(ids, adapter, spec)
            for stream in (False, True):
                got = complete(server, ref, adapter, ids, rf, stream=stream)
                assert got == (text, reason, len(tokens)), (adapter, prompt, stream)
            chat_ids = ref.chat_ids([{"role": "user", "content": prompt}])
            tokens, text, reason = ref.generate(chat_ids, adapter, spec)
            message, got_reason, n = complete(server, ref, adapter, prompt, rf, chat=True, stream=k == 1)
            assert (message["content"], got_reason, n) == (text, reason, len(tokens))
            for answer, why in ((text, reason),):
                if why == "stop":
                    jsonschema.validate(json.loads(answer), PERSON)
                    finished += 1
    assert finished >= 4


def required_spec(tools) -> GrammarSpec:
    """tool_choice "required"'s grammar as vLLM builds it: a JSON array (one item or more) of
    {"name": <a tool's name>, "parameters": <its parameters>}, the tools' $defs moved to the array's
    root (vLLM's get_tool_schema_defs)."""
    items, defs = [], {}
    for t in tools:
        parameters = dict(t["function"].get("parameters", {"type": "object"}))
        defs.update(parameters.pop("$defs", {}))
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                       "parameters": parameters}, "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    return GrammarSpec("json_schema", {**schema, "$defs": defs} if defs else schema)


REGEX = r"[a-c]{2,6}(x|yz)"
AUTO_REGEX = (r'(Sure\. )?<tool_call>\{"name": "get_weather", "arguments": \{"city": "(paris|oslo|rome)", '
              r'"days": [1-7]\}\}</tool_call>')
CASES = {  # name: (extra body fields, the grammar stock generate() runs with, the endpoint is chat)
    "json_object": ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object"), True),
    "json_schema_not_strict": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON, "strict": False}}}, GrammarSpec("json_schema", PERSON), False),
    "structured_outputs.json": ({"structured_outputs": {"json": json.dumps(PERSON)}},
                                GrammarSpec("json_schema", PERSON), False),
    "structured_outputs.regex": ({"structured_outputs": {"regex": REGEX}}, GrammarSpec("regex", REGEX), False),
    "structured_outputs.choice": ({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
                                  GrammarSpec("choice", ["yes", "no", "maybe so"]), True),
    "structured_outputs.grammar": ({"structured_outputs": {"grammar": EBNF}}, GrammarSpec("grammar", EBNF), False),
    "structured_outputs.json_object": ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object"),
                                       False),
    "guided_json": ({"guided_json": PERSON, "guided_decoding_backend": "xgrammar"},
                    GrammarSpec("json_schema", PERSON), True),
    "guided_regex": ({"guided_regex": REGEX}, GrammarSpec("regex", REGEX), True),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, GrammarSpec("choice", ["yes", "no"]), False),
    "guided_grammar": ({"guided_grammar": EBNF, "guided_decoding_backend": "auto"}, GrammarSpec("grammar", EBNF),
                       True),
}


def check_valid(text: str, spec: GrammarSpec) -> None:
    """``text`` (an answer that finished) is in the language of ``spec``."""
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), spec.value if isinstance(spec.value, dict) else json.loads(spec.value))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    elif spec.kind == "choice":
        assert text in spec.value
    else:  # EBNF
        assert re.fullmatch(r"\((([a-c]+|none),)*([a-c]+|none)\)", text), text


@pytest.mark.parametrize("case", list(CASES))
def test_each_field_equals_stock_generate(server, ref, case):
    """Every structured-output field, on its endpoint, streamed for one adapter: stock's answer under
    its grammar, token for token; answers that finish are in its language."""
    extra, spec, chat = CASES[case]
    finished = 0
    for adapter, prompt in (("s", PROMPTS[0]), ("c", PROMPTS[2]), (BASE_ID, PROMPTS[1])):
        ids = ref.chat_ids([{"role": "user", "content": prompt}]) if chat else ref.tok(prompt)["input_ids"]
        tokens, text, reason = ref.generate(ids, adapter, spec)
        got, got_reason, n = complete(server, ref, adapter, prompt if chat else ids, extra, chat=chat,
                                      stream=adapter == "c")
        content = got["content"] if chat else got
        assert (content, got_reason, n) == (text, reason, len(tokens)), (adapter, prompt)
        if chat:
            assert "tool_calls" not in got
        if reason == "stop":
            check_valid(text, spec)
            finished += 1
    assert finished >= (1 if spec.kind == "json_object" else 2), case  # any JSON value: ]]]] runs on longer


def test_answers_are_valid(server, ref):
    """Schemas with bounds, over many prompts and adapters: every answer that finishes is valid, and most finish."""
    schemas = [PERSON, {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "maxItems": 4},
               {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
                "required": ["ok", "tag"], "additionalProperties": False}]
    rng = random.Random(0)
    jobs = [(schema, adapter, "".join(rng.choice("abcdefgh {}[]\":,") for _ in range(12)))
            for schema in schemas for adapter in ("s", "b", "c", BASE_ID)]

    def run(job):
        schema, adapter, prompt = job
        rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        return complete(server, ref, adapter, prompt, rf)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(run, jobs))
    finished = 0
    for (schema, _, _), (text, reason, _) in zip(jobs, answers):
        assert reason in ("stop", "length")
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            finished += 1
    assert finished >= 0.75 * len(jobs), answers


# --- tools ---


def test_hermes_parser():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert parse_hermes(call) == (None, [("add", '{"a": 1, "b": 2}')])
    assert parse_hermes(f"Sure.\n{call}\n<tool_call>\n  {{\"name\": \"note\"}}\n</tool_call>\n") == \
        ("Sure.\n\n\n", [("add", '{"a": 1, "b": 2}'), ("note", "{}")])
    # the last block may lack its closing tag (the model ended there)
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"x": "é"}}') == (None, [("f", '{"x": "é"}')])
    # a block that does not parse stays in the text; no block: the text as it is
    bad = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parse_hermes(bad + call) == (bad, [("add", '{"a": 1, "b": 2}')])
    for text in ("hello", "", "  ", bad, '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>[1]</tool_call>",
                 '<tool_call>{"name": "f", "arguments": 3}</tool_call>'):
        assert parse_hermes(text) == (text, [])
    assert parse_required('[{"name": "add", "parameters": {"a": 1}}, {"name": "note", "parameters": {}}]') == \
        [("add", '{"a": 1}'), ("note", "{}")]
    for text in ('[{"name": "add", "parameters": {"a": 1}', "[]", '{"name": "add"}', '[{"name": "add"}]'):
        assert parse_required(text) is None


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_streamed_tool_deltas_join_up_to_the_answer(mode):
    """ToolCalls on strings cut at random places: the chunks' deltas joined (content pieces, tool
    calls by index) are the whole answer, finish_reason included."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    texts = {"auto": ["", "  ", "hello", "Sure.\n" + call, call, " \n" + call + " after", call + "\n" + call,
                      "x <tool_ca", "a <tool_call>{bad}</tool_call> b", "<tool_call>{bad}</tool_call>" + call,
                      "<tool_call>" + call[11:-12]],
             "required": ['[{"name": "add", "parameters": {"a": 1}}]', '[{"name": "add", "par', "",
                          '[{"name": "add", "parameters": {}}, {"name": "note", "parameters": {"x": [1]}}]'],
             "named": ['{"a": 1, "b": 2}', "", '{"a": 1']}[mode]
    rng = random.Random(1)
    for text in texts:
        for reason in ("stop", "length"):
            for _ in range(20):
                whole = ToolCalls(mode, "add")
                content, calls, final = whole.result(text, reason)
                streamed = ToolCalls(mode, "add")
                cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 \
                    else []
                pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
                deltas = [{"role": "assistant", "content": None}] + [streamed.feed(p) for p in pieces]
                rest, got_reason = streamed.finish(text, reason)
                message = assemble(deltas + rest)
                expected = {"role": "assistant", "content": content}
                if calls:
                    expected["tool_calls"] = calls
                assert without_ids(message) == without_ids(expected), (text, pieces)
                if mode == "named":  # one id per choice, whole or streamed
                    assert message["tool_calls"][0]["id"] == streamed.result(text, reason)[1][0]["id"]
                assert got_reason == final
                if mode == "auto":
                    assert final == ("tool_calls" if calls else reason)


def tool_call(name, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def check_required_named_none(server, ref, tools, named, prompts) -> int:
    """required: stock's answer under vLLM's array grammar, parsed into tool calls (each valid under
    its tool's parameters); named (each of ``named``): the answer is the function's arguments; none:
    tools rendered, the text as it is. Streamed the same. The answers of required that finished."""
    finished = 0
    for adapter, prompt in prompts:
        ids = ref.chat_ids([{"role": "user", "content": prompt}], tools)
        # required
        tokens, text, reason = ref.generate(ids, adapter, required_spec(tools))
        for stream in (False, True):
            message, got_reason, n = complete(server, ref, adapter, prompt, {"tools": tools, "tool_choice": "required"},
                                              chat=True, stream=stream)
            assert n == len(tokens)
            if reason == "stop":
                calls = json.loads(text)
                expected = {"role": "assistant", "content": None,
                            "tool_calls": [tool_call(c["name"], json.dumps(c["parameters"])) for c in calls]}
                assert (without_ids(message), got_reason) == (expected, "tool_calls")
                for c in calls:
                    schema = next(t for t in tools if t["function"]["name"] == c["name"])["function"].get("parameters")
                    jsonschema.validate(c["parameters"], schema or {"type": "object"})
                finished += 1
            else:
                assert (message, got_reason) == ({"role": "assistant", "content": text}, "length")
        # named
        for tool in named:
            name = tool["function"]["name"]
            spec = GrammarSpec("json_schema", tool["function"].get("parameters", {"type": "object"}))
            tokens, text, reason = ref.generate(ids, adapter, spec)
            choice = {"type": "function", "function": {"name": name}}
            for stream in (False, True):
                message, got_reason, n = complete(server, ref, adapter, prompt, {"tools": tools, "tool_choice": choice},
                                                  chat=True, stream=stream)
                expected = {"role": "assistant", "content": None, "tool_calls": [tool_call(name, text)]}
                assert (without_ids(message), got_reason, n) == (expected, reason, len(tokens))
            if reason == "stop":
                jsonschema.validate(json.loads(text), spec.value)
        # none: no constraint, no parsing
        tokens, text, reason = ref.generate(ids, adapter, None, max_tokens=12, bias=False)
        for stream in (False, True):
            message, got_reason, n = complete(server, ref, adapter, prompt, {"tools": tools, "tool_choice": "none"},
                                              chat=True, stream=stream, bias=False, max_tokens=12)
            assert (message, got_reason, n) == ({"role": "assistant", "content": text}, reason, len(tokens))
    return finished


TOOL_PROMPTS = (("s", "weather in oslo"), ("b", "add 2 and 3"), (BASE_ID, PROMPTS[0]))


def test_tool_choice_required_named_and_none(server, ref):
    assert check_required_named_none(server, ref, TOOLS, (WEATHER, NOTE), TOOL_PROMPTS) >= 3


def test_tool_parameters_with_defs(server, ref):
    """Parameters that refer to their own $defs ("$ref": "#/$defs/Unit", vLLM's weather tools):
    required moves every tool's $defs to the root of the array of calls, as vLLM does (a definition
    both tools share is one); named compiles the parameters as they are."""
    assert check_required_named_none(server, ref, DEFS_TOOLS, DEFS_TOOLS, TOOL_PROMPTS[:2]) >= 2


def check_auto(server, ref, prompts) -> int:
    """auto: no constraint of its own; a regex (structured_outputs) makes the model write a Hermes
    call, which comes back as a tool call, with the text before it as content, streamed the same;
    without a call the text is the content. The calls that came back."""
    calls = 0
    for adapter, prompt in prompts:
        ids = ref.chat_ids([{"role": "user", "content": prompt}], TOOLS)
        tokens, text, reason = ref.generate(ids, adapter, GrammarSpec("regex", AUTO_REGEX), max_tokens=150,
                                            bias=False)
        assert reason == "stop" and re.fullmatch(AUTO_REGEX, text)
        block = json.loads(text[text.index("{"):text.rindex("}") + 1])
        expected = {"role": "assistant", "content": text[:text.index("<tool_call>")] or None,
                    "tool_calls": [tool_call("get_weather", json.dumps(block["arguments"]))]}
        for stream in (False, True):
            message, got_reason, n = complete(server, ref, adapter, prompt,
                                              {"tools": TOOLS, "structured_outputs": {"regex": AUTO_REGEX}},
                                              chat=True, stream=stream, bias=False, max_tokens=150)
            assert (without_ids(message), got_reason, n) == (expected, "tool_calls", len(tokens))
            calls += 1
        # no call in the text: the text, as without tools
        tokens, text, reason = ref.generate(ids, adapter, None, max_tokens=10, bias=False)
        for stream in (False, True):
            message, got_reason, n = complete(server, ref, adapter, prompt, {"tools": TOOLS}, chat=True,
                                              stream=stream, bias=False, max_tokens=10)
            assert (message, got_reason, n) == ({"role": "assistant", "content": text}, reason, len(tokens))
    return calls


def test_tool_choice_auto_parses_hermes_calls(server, ref):
    assert check_auto(server, ref, (("s", "weather in oslo"), ("c", "weather?"), (BASE_ID, "hi"))) == 6


def test_openai_client_parse_and_a_tool_call_loop(client, ref):
    """client.chat.completions.parse(response_format=a pydantic model), and a tool-call loop: the
    calls come back, their results go in as role "tool" messages, and the next answer is stock's on
    the conversation rendered with them."""
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=5)
        age: int = pydantic.Field(ge=0, le=99)

    bias = {k: 3 for k in ref.bias()}
    parsed = 0
    for adapter in ("s", "b"):
        r = client.chat.completions.parse(model=adapter, messages=[{"role": "user", "content": "who?"}],
                                          response_format=Person, max_tokens=MAX_TOKENS, temperature=0,
                                          logit_bias=bias)
        if r.choices[0].finish_reason == "stop":
            person = r.choices[0].message.parsed
            assert isinstance(person, Person) and person == Person.model_validate_json(r.choices[0].message.content)
            parsed += 1
    assert parsed >= 1

    messages = [{"role": "user", "content": "weather in rome, and 2 + 3?"}]
    first = client.chat.completions.create(model="b", messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=MAX_TOKENS, temperature=0, logit_bias=bias)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    messages.append(choice.message.model_dump(exclude_none=True))
    rendered = [dict(messages[0]), {"role": "assistant", "content": "", "tool_calls": []}]
    for k, call in enumerate(choice.message.tool_calls):
        assert call.type == "function" and call.function.name in {t["function"]["name"] for t in TOOLS}
        arguments = json.loads(call.function.arguments)
        result = json.dumps({"result": k + 21})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        rendered[1]["tool_calls"].append(tool_call(call.function.name, arguments))
        rendered.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = client.chat.completions.create(model="b", messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    ids = ref.chat_ids(rendered, TOOLS)
    assert ids[-40:] != ref.chat_ids(rendered[:1], TOOLS)[-40:]
    assert "<tool_response>" in ref.tok.decode(ids) and '"result": 21' in ref.tok.decode(ids)
    tokens, text, reason = ref.generate(ids, "b", None, max_tokens=12, bias=False)
    assert second.usage.prompt_tokens == len(ids)
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == (text, reason)


# --- concurrency ---


def test_mixed_batch_equals_each_alone(server, ref):
    """Constrained, tool and free requests on several adapters at once, streamed and not: each
    answer is its answer alone (tool call ids aside)."""
    jobs = [
        ("s", PROMPTS[0], CASES["json_schema_not_strict"][0], False, False),
        ("b", PROMPTS[1], CASES["structured_outputs.regex"][0], False, True),
        ("c", "pick", CASES["structured_outputs.choice"][0], True, False),
        (BASE_ID, PROMPTS[2], CASES["guided_grammar"][0], True, True),
        ("s", "add 1 and 2", {"tools": TOOLS, "tool_choice": "required"}, True, False),
        ("b", "weather", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}}, True,
         True),
        ("c", "weather", {"tools": TOOLS, "structured_outputs": {"regex": AUTO_REGEX}}, True, True),
        ("b", PROMPTS[0], {}, False, False),
        (BASE_ID, "hello", {"tools": TOOLS}, True, True),
        ("c", PROMPTS[1], {}, True, False),
    ]

    def run(job):
        adapter, prompt, extra, chat, stream = job
        got = complete(server, ref, adapter, prompt if chat else ref.tok(prompt)["input_ids"], extra, chat=chat,
                       stream=stream, max_tokens=40)
        return (without_ids(got[0]) if chat else got[0]), *got[1:]

    alone = [run(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for _ in range(2):
            assert list(pool.map(run, jobs)) == alone


# --- bad input ---


BAD = [  # (endpoint, extra fields, the param the 400 names)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": "json"}, "response_format"),
    ("completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"json": {"$ref": "#/nope"}}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("completions", {"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ("completions", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ("completions", {"structured_outputs": [1]}, "structured_outputs"),
    ("completions", {"guided_json": {"type": 5}}, "guided_json"),
    ("completions", {"guided_json": 5}, "guided_json"),
    ("chat", {"guided_regex": "[a-z"}, "guided_regex"),
    ("chat", {"guided_choice": ["a", 3]}, "guided_choice"),
    ("chat", {"guided_choice": []}, "guided_choice"),
    ("chat", {"guided_grammar": "root := 'a'"}, "guided_grammar"),
    ("chat", {"guided_regex": "a+", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("completions", {"guided_json": PERSON, "structured_outputs": {"regex": "a"}}, "guided_json"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ("chat", {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
              "tool_choice": "required"}, "tools[1].function.parameters"),
    ("chat", {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[1].function.parameters"),
    ("chat", {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[1].function.parameters"),
    ("chat", {"tools": [FORECAST, {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": {"enum": ["k"]}}}}}],
              "tool_choice": "required"}, "tools[1].function.parameters"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}],
              "tool_choice": "required"}, "tools[0].function.parameters"),
    ("chat", {"tools": {"name": "f"}}, "tools"),
    ("chat", {"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ("chat", {"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ("chat", {"tools": [ADD, ADD]}, "tools[1].function.name"),
    ("chat", {"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ("chat", {"tools": TOOLS, "tool_choice": "auto", "echo": True}, "echo"),
    ("completions", {"tools": TOOLS}, "tools"),
    ("completions", {"tool_choice": "auto"}, "tool_choice"),
]


def check_refused(status, reply, param):
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    text = json.dumps(reply)
    assert not any(s in text for s in ("Traceback", ".cc:", "/project", 'File "')), text


@pytest.mark.parametrize("endpoint, extra, param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, endpoint, extra, param):
    body = {"model": "s", "max_tokens": 4, **extra}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    status, reply = request(server, f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", body)
    check_refused(status, reply, param)


def slow_grammar(tag: str = "") -> str:
    """An EBNF grammar of 64 KB whose compilation grows with the square of its chain of rules that
    may be empty (each token can end in any of them): about 7 s on this 320-token vocabulary on a
    busy 2-core machine, against COMPILE_TIMEOUT. ``tag``: another grammar of the same cost."""
    rules = [f"r{i} ::= [a-z]* r{i + 1} | [0-9]+ r{i + 1}" for i in range(1790)]
    return "\n".join(["root ::= r0", *rules, f'r1790 ::= "e{tag}"'])


def test_compile_bounds(server, ref):
    """A grammar that takes longer than --grammar-compile-timeout to compile is refused, and the next
    request compiles as usual (a new compiling process, its start not counted in the timeout);
    regexes of huge counted repetitions, cheap for xgrammar, are served at once."""
    start = time.monotonic()
    status, reply = request(server, "/v1/completions", {"model": "s", "prompt": "hi", "max_tokens": 4,
                                                         "guided_grammar": slow_grammar()})
    check_refused(status, reply, "guided_grammar")
    assert f"longer than {COMPILE_TIMEOUT:g} s" in reply["error"]["message"], reply
    assert time.monotonic() - start < COMPILE_TIMEOUT + 15
    fresh = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 7}}, "required": ["n"]}
    ids = ref.tok(PROMPTS[0])["input_ids"]
    tokens, text, reason = ref.generate(ids, "s", GrammarSpec("json_schema", fresh))
    got = complete(server, ref, "s", ids, {"guided_json": fresh})
    assert got == (text, reason, len(tokens))
    for regex, alphabet in (("(a{1000}){1000}", "a"), ("[a-z]{1,1000000}", "abcdefghijklmnopqrstuvwxyz")):
        start = time.monotonic()
        text, reason, n = complete(server, ref, "b", "hi", {"guided_regex": regex}, max_tokens=10, bias=False)
        assert time.monotonic() - start < 30
        assert text and set(text) <= set(alphabet) and (reason, n) == ("length", 10)


# SmolLM2-135M-Instruct's own chat template (ChatML): no tool format, tools are not shown
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chatml(files, tmp_path_factory):
    """(server URL, Reference) of the same model and adapters with SMOLLM2_TEMPLATE as the chat template."""
    root = tmp_path_factory.mktemp("serve_structured_chatml")
    shutil.copytree(files / "adapters", root / "adapters")
    shutil.copytree(files / "base", root / "base")
    tok = AutoTokenizer.from_pretrained(root / "base")
    tok.chat_template = SMOLLM2_TEMPLATE
    tok.save_pretrained(root / "base")
    with launch(root, root / "server.log") as (url, _):
        yield url, Reference(root)


def test_tools_on_a_template_without_a_tool_format(chatml):
    """A template without a tool format (SmolLM2-135M-Instruct's) gets the tools as any template does,
    as vLLM passes them, and shows none of them: the prompt is the messages' alone. named and
    required constrain the output to the tool's parameters / the array of calls all the same, none
    is the text, auto parses Hermes blocks in it: each stock generate()'s on that prompt, streamed
    and not."""
    url, ref = chatml
    messages = [{"role": "user", "content": "weather in oslo"}]
    assert ref.chat_ids(messages, TOOLS) == ref.chat_ids(messages)  # the template ignores the tools
    assert check_required_named_none(url, ref, TOOLS, (WEATHER, NOTE), TOOL_PROMPTS[:2]) >= 2
    assert check_auto(url, ref, (("s", "weather in oslo"), (BASE_ID, "hi"))) == 4


# --- the compiler under load, and killed ---


PENDING = 2  # --max-pending-grammars of the watched server


@pytest.fixture(scope="module")
def watched(files, tmp_path_factory):
    """(URL, process, log file) of a server of its own, with --max-pending-grammars PENDING."""
    log = tmp_path_factory.mktemp("serve_structured_watched") / "server.log"
    with launch(files, log, "--grammar-compile-timeout", str(COMPILE_TIMEOUT), "--max-pending-grammars",
                str(PENDING)) as (url, proc):
        yield url, proc, log


def test_slow_grammars_hold_up_nothing_else(watched):
    """48 requests at once, each a slow grammar of its own (each refused at the timeout): they wait
    for the compiler's own thread, PENDING at a time, the rest a 429 at once (grammar_queue_full,
    never a 5xx), so a plain completion is answered promptly meanwhile (it waited behind them for a
    thread of the pool every request needs: 30 s and more); a grammar refused before is refused at
    once (it took the timeout again)."""
    url, _, _ = watched
    bodies = [{"model": "s", "prompt": "hi", "max_tokens": 4, "guided_grammar": slow_grammar(str(i))}
              for i in range(48)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(request, url, "/v1/completions", body) for body in bodies]
        time.sleep(1)
        start = time.monotonic()
        plain = post(url, "/v1/completions", {"model": "b", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        took = time.monotonic() - start
        replies = [f.result() for f in futures]
    assert plain["usage"]["completion_tokens"] and took < 12, took
    statuses = [status for status, _ in replies]
    assert set(statuses) <= {400, 429} and statuses.count(429) >= len(bodies) - 4 * PENDING, statuses
    for status, reply in replies:
        if status == 429:
            assert reply["error"]["code"] == "grammar_queue_full" and reply["error"]["type"] == "server_error"
        else:
            check_refused(status, reply, "guided_grammar")
            assert f"longer than {COMPILE_TIMEOUT:g} s" in reply["error"]["message"]
    refused = next(body for body, (status, _) in zip(bodies, replies) if status == 400)
    start = time.monotonic()
    status, reply = request(url, "/v1/completions", refused)
    assert time.monotonic() - start < 1.0 < COMPILE_TIMEOUT
    check_refused(status, reply, "guided_grammar")
    assert f"longer than {COMPILE_TIMEOUT:g} s" in reply["error"]["message"]


def grammar_worker(parent: int, other_than: int | None = None) -> int | None:
    """The pid of ``parent``'s grammar worker (a live child running grammar_worker.py), or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == other_than:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"grammar_worker.py" in command:
            return int(entry)
    return None


def test_a_killed_grammar_worker_is_not_the_requests_fault(watched, ref):
    """The grammar worker killed while idle, or while it starts: the next request's grammar compiles
    in a new one, and the answer is stock's (it was a 400 blaming the schema's memory, or a 500);
    the server's log says each kill was seen."""
    url, proc, log = watched
    ids = ref.tok(PROMPTS[0])["input_ids"]
    for n, kill_while_starting in enumerate((False, True)):
        schema = {"type": "object", "properties": {f"k{n}": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": [f"k{n}"]}
        tokens, text, reason = ref.generate(ids, "s", GrammarSpec("json_schema", schema))
        regex = f"[a-c]{{{n + 9}}}"  # a grammar of its own: compiled in the worker, which is idle after
        post(url, "/v1/completions", {"model": "b", "prompt": "hi", "max_tokens": 2, "guided_regex": regex})
        pid = grammar_worker(proc.pid)
        os.kill(pid, signal.SIGKILL)
        killer = None
        if kill_while_starting:
            def kill_next(old=pid):
                while (new := grammar_worker(proc.pid, other_than=old)) is None:
                    time.sleep(0.005)
                os.kill(new, signal.SIGKILL)

            killer = ThreadPoolExecutor(1).submit(kill_next)
        assert complete(url, ref, "s", ids, {"guided_json": schema}) == (text, reason, len(tokens))
        if killer is not None:
            killer.result(60)
    seen = log.read_text()
    assert "grammar compiler's process ended (SIGKILL)" in seen, seen[-3000:]
    assert "ended while starting (SIGKILL)" in seen, seen[-3000:]
