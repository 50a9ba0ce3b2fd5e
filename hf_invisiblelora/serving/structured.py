"""Structured outputs and tools on the API: the request fields that constrain an output to a grammar
(OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields),
``tools`` and ``tool_choice`` on a chat, the Hermes-style tool-call parser, and a chat answer's tool
calls, whole or streamed. The grammars are xgrammar's, compiled by
the server's ``Grammars`` (grammars.py) off the event loop before a request is submitted; the
masks under speculation are decode/grammar.py's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from .grammars import CompilerUnavailable, GrammarError, Grammars, GrammarsBusy, GrammarSpec
from .errors import ApiError, bad, show

logger = logging.getLogger("hf_invisiblelora.serve")

GRAMMAR_COMPILE_TIMEOUT = 10.0  # --grammar-compile-timeout, seconds

# vLLM's structured_outputs keys -> GrammarSpec kinds
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS, "guided_decoding_backend")
BACKENDS = ("xgrammar", "auto")  # guided_decoding_backend: what we are; anything else is refused
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class Constraint:
    """What a request's output is compiled to: the field it came from (``param``: errors name it)
    and its grammar. ``parts``: for tool_choice "required", each tool's parameters (param, spec),
    compiled one by one to name the tool when the whole does not compile."""

    param: str
    spec: GrammarSpec
    parts: tuple = ()


def _constraint(param: str, kind: str, value) -> Constraint:
    spec = GrammarSpec(kind, value)
    try:
        spec.key()  # types and size, before anything is compiled
    except GrammarError as e:
        raise bad(param, f"`{param}`: {e}.") from None
    return Constraint(param, spec)


def _response_format(value) -> Constraint | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad(param, "`response_format` must be an object with a `type`: \"text\", \"json_object\" or "
                         "\"json_schema\".")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(param, GrammarSpec("json_object"))
    if kind != "json_schema":
        raise ApiError(400, f"`response_format.type` {show(kind)} is not supported; the types are \"text\", "
                       "\"json_object\" and \"json_schema\".", param=param, code="unsupported_parameter")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad(param, "`response_format.json_schema` must be an object with a `schema` (and a `name`).")
    for key, types, what in (("name", str, "a string"), ("description", str, "a string"),
                             ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], types):
            raise bad(param, f"`response_format.json_schema.{key}` must be {what}.")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise bad(param, "`response_format.json_schema.schema` must be a JSON schema (an object).")
    return _constraint(param, "json_schema", schema)  # strict or not: the schema is the constraint


def _structured_outputs(value) -> Constraint | None:
    if not isinstance(value, dict):
        raise bad("structured_outputs", "`structured_outputs` must be an object with one of "
                                        f"{', '.join(STRUCTURED_KEYS)}.")
    given = {}
    for key, v in value.items():
        param = f"structured_outputs.{key}" if isinstance(key, str) and len(key) <= 64 else "structured_outputs"
        if key not in STRUCTURED_KEYS:
            raise ApiError(400, f"`{param}` is not supported; the keys are {', '.join(STRUCTURED_KEYS)}.",
                           param=param, code="unsupported_parameter")
        if key == "json_object":
            if v is not None and not isinstance(v, bool):
                raise bad(param, f"`{param}` must be a boolean.")
            v = True if v else None
        if key == "json" and not isinstance(v, (dict, str, bool, type(None))):
            raise bad(param, f"`{param}` must be a JSON schema (an object, or its JSON text).")
        if v is not None:
            given[key] = v
    if len(given) > 1:
        raise bad("structured_outputs", f"`structured_outputs` takes one constraint; got {', '.join(given)}.")
    if not given:
        return None
    (key, v), = given.items()
    param = f"structured_outputs.{key}"
    return Constraint(param, GrammarSpec("json_object")) if key == "json_object" else \
        _constraint(param, STRUCTURED_KEYS[key], v)


def output_constraints(body: dict) -> list[Constraint]:
    """The constraints the request's structured-output fields ask for (checked, not compiled): none,
    one, or more (which the caller refuses)."""
    found = []
    if body.get("response_format") is not None:
        found.append(_response_format(body["response_format"]))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            if kind == "json_schema" and not isinstance(body[name], (dict, str, bool)):
                raise bad(name, f"`{name}` must be a JSON schema (an object, or its JSON text).")
            found.append(_constraint(name, kind, body[name]))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise ApiError(400, f"`guided_decoding_backend` {show(backend)} is not served; this server's is xgrammar "
                       "(\"xgrammar\" or \"auto\").", param="guided_decoding_backend", code="unsupported_parameter")
    return [c for c in found if c is not None]


# --- tools ---


@dataclass
class Tools:
    """A chat's ``tools`` (as the chat template takes them) and ``tool_choice``: ``mode`` "none",
    "auto", "required" or "named" (``name``: the function); ``constraint``: what required and named
    compile the output to."""

    tools: list
    mode: str
    name: str | None = None
    constraint: Constraint | None = None
    names: list = field(default_factory=list)


def _lifted_defs(schemas: list) -> tuple[dict, list]:
    """(every tool's ``$defs`` merged, each tool's parameters without its own) for tool_choice
    "required": a tool's "#/$defs/..." references point at the root of the schema they are in, which
    in the array of calls is the array's, so the definitions move there, as vLLM's
    get_tool_schema_defs moves them. One name defined differently by two tools is a 400, as in vLLM."""
    merged, stripped = {}, []
    for i, schema in enumerate(schemas):
        defs = schema.get("$defs") if schema is not None else None
        if defs is None:
            stripped.append(schema)
            continue
        param = f"tools[{i}].function.parameters"
        if not isinstance(defs, dict):
            raise bad(param, f"`{param}.$defs` must be an object of schemas.")
        for name, definition in defs.items():
            if merged.setdefault(name, definition) != definition:
                raise bad(param, f"`{param}.$defs` defines {show(name)} unlike an earlier tool: with tool_choice "
                                 "\"required\" the tools' $defs share one namespace (as in vLLM), so a name must "
                                 "mean one schema.")
        stripped.append({k: v for k, v in schema.items() if k != "$defs"})
    return merged, stripped


def parse_tools(body: dict) -> Tools | None:
    """The chat's tools and tool_choice, checked (400 naming the field); None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "`tools` must be a list of {\"type\": \"function\", \"function\": {...}} objects.")
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", "`tool_choice` needs `tools`.")
        return None
    rendered, names, schemas = [], [], []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(where, f"`{where}` must be {{\"type\": \"function\", \"function\": {{\"name\", \"description\", "
                             "\"parameters\"}}.")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.function.name", f"`{where}.function.name` must be 1-64 letters, digits, _ . : or -.")
        if name in names:
            raise bad(f"{where}.function.name", f"Two tools are named {name!r}.")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad(f"{where}.function.description", f"`{where}.function.description` must be a string.")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise bad(f"{where}.function.strict", f"`{where}.function.strict` must be a boolean.")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad(f"{where}.function.parameters", f"`{where}.function.parameters` must be a JSON schema (an "
                                                      "object).")
        names.append(name)
        schemas.append(parameters)
        entry = {"name": name}
        for key in ("description", "parameters"):
            if function.get(key) is not None:
                entry[key] = function[key]
        rendered.append({"type": "function", "function": entry})
    if choice is None or choice in ("auto", "none"):
        return Tools(rendered, choice or "auto", names=names)
    if choice == "required":
        # vLLM's: a JSON array of one or more {"name": <a tool's name>, "parameters": <its parameters>}
        defs, parameters = _lifted_defs(schemas)
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                    "parameters": s if s is not None else {"type": "object"}},
                  "required": ["name", "parameters"]} for n, s in zip(names, parameters)]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if defs:
            schema["$defs"] = defs
        parts = tuple((f"tools[{i}].function.parameters", GrammarSpec("json_schema", s))
                      for i, s in enumerate(schemas) if s is not None)
        return Tools(rendered, "required", constraint=Constraint("tools", GrammarSpec("json_schema", schema), parts),
                     names=names)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad("tool_choice", f"`tool_choice` names the function {show(name)}, which is not in `tools`.")
        i = names.index(name)
        schema = schemas[i] if schemas[i] is not None else {"type": "object"}
        return Tools(rendered, "named", name=name, names=names,
                     constraint=_constraint(f"tools[{i}].function.parameters", "json_schema", schema))
    raise bad("tool_choice", "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}.")


def message_tool_calls(calls, i: int) -> list:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's arguments (a
    JSON string in the API) parsed into an object where they are one, as most templates want."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad("messages", f"`{where}` must be a list of tool calls.")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("arguments", ""), (str, dict)):
            raise bad("messages", f"`{where}[{j}]` must be {{\"id\", \"type\": \"function\", \"function\": "
                                  "{\"name\", \"arguments\"}}.")
        arguments = function.get("arguments", "")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


# --- the compiler ---


_XGRAMMAR_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")  # xgrammar's "[time] file.cc:line: " before its words


def grammar_message(error: GrammarError, spec: GrammarSpec) -> str:
    """A GrammarError in the API's words: xgrammar's own message without its time and source
    location; C++'s bad_alloc (the compiling process's memory bound) said as such."""
    text = _XGRAMMAR_PREFIX.sub("", str(error))
    if "bad_alloc" in text:
        return f"compiling the {spec.kind} needs more memory than a grammar may use"
    return text if len(text) <= 500 else text[:497] + "..."


def make_grammars(tokenizer, vocab_size: int, stop_token_ids, timeout: float, max_pending: int):
    """(Grammars or None, why not): None where xgrammar is not installed or cannot read the tokenizer."""
    try:
        return Grammars(tokenizer, vocab_size, stop_token_ids=stop_token_ids, timeout=timeout,
                        max_pending=max_pending), None
    except ImportError:
        return None, "xgrammar is not installed (pip install \"hf-invisiblelora[structured]\")"
    except Exception as e:  # noqa: BLE001 - a tokenizer xgrammar cannot read: served without structured outputs
        logger.warning("structured outputs are off: xgrammar cannot read this tokenizer (%s)", e)
        return None, "xgrammar cannot read this model's tokenizer"


async def _compiled(grammars: Grammars, spec: GrammarSpec):
    """``spec``'s CompiledGrammar: looked up on a pool thread (reading a large schema takes a while),
    compiled on the compiler's own (Grammars.submit), so a request waiting for its grammar holds no
    thread of the pool every request needs. Shielded: a request that goes away while it waits does
    not cancel a compilation other requests share."""
    future = await run_in_threadpool(grammars.submit, spec)
    return await asyncio.shield(asyncio.wrap_future(future))


async def compile_constraint(grammars: Grammars, constraint: Constraint):
    """The CompiledGrammar of ``constraint``, at once if it was compiled before. A 400 naming the
    field for an invalid, unsupported or too costly one (at once if it was refused before): for
    tool_choice "required", traced to the tool whose parameters do not compile where one does not.
    429 when Grammars.max_pending other grammars wait to be compiled (a retry after a compilation's
    time may find room, or the grammar compiled); 503 when the compiler's process cannot be run."""
    try:
        return await _compiled(grammars, constraint.spec)
    except GrammarError as e:
        param, error, spec = constraint.param, e, constraint.spec
        if constraint.parts and str(e).startswith("invalid") and "bad_alloc" not in str(e):
            for part, part_spec in constraint.parts:
                try:
                    await _compiled(grammars, part_spec)
                except GrammarError as e2:
                    param, error, spec = part, e2, part_spec
                    break
                except (GrammarsBusy, CompilerUnavailable):
                    break  # not traced: the whole's error stands
        raise ApiError(400, f"`{param}` cannot be served: {grammar_message(error, spec)}.", param=param,
                       code="invalid_value") from None
    except GrammarsBusy as e:
        raise ApiError(429, f"{grammars.max_pending} grammars are waiting to be compiled already (this server's "
                       "bound); retry later.", type="server_error", code="grammar_queue_full",
                       headers={"Retry-After": str(math.ceil(grammars.timeout))}) from e
    except CompilerUnavailable as e:
        raise ApiError(503, "The grammar compiler cannot be run now (the server's log says why); retry later.",
                       type="server_error", code="grammar_compiler_unavailable", cause=e) from e
