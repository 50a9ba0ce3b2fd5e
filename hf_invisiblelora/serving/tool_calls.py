"""A chat answer's tool calls, read from its text as it streams: Hermes-style ``<tool_call>`` blocks
(tool_choice "auto"), vLLM's JSON array of calls (tool_choice "required"), or a named function's
arguments; OpenAI's message and delta shapes (``ToolCalls``). What constrains the output to them is
structured.py's.
"""

from __future__ import annotations

import json
import re
import secrets

from .text import held_tail

TOOL_CALL_OPEN = "<tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _hermes_call(body: str):
    """(name, arguments as JSON text) of one block's ``{"name": ..., "arguments": {...}}``, or None."""
    try:
        call = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def parse_hermes(text: str):
    """(content, [(name, arguments)]) of a Hermes-style output (vLLM's ``--tool-call-parser hermes``):
    each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block (whitespace inside
    allowed; the last one may lack its closing tag) is a call; a block that does not parse stays in
    the text. Without calls, the content is the text; with some, the text less their blocks, None
    if that is only whitespace."""
    calls, kept, pos = [], [], 0
    for m in _HERMES.finditer(text):
        call = _hermes_call(m.group(1) if m.group(1) is not None else m.group(2))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept)
    return (content if content.strip() else None), calls


def parse_required(text: str):
    """[(name, arguments)] of tool_choice "required"'s output (a JSON array of {"name", "parameters"}),
    or None if it is not one (cut short by max_tokens or a stop string)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in calls):
        return None
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


class ToolCalls:
    """One choice's tool calls, read from its text by its chat's tool_choice (``mode``): "auto"
    (parse_hermes), "required" (parse_required) or "named" (the text is the named function's
    arguments). ``result`` gives the answer's (content, tool_calls, finish_reason); streaming,
    ``feed`` gives each delta's fields as the text comes and ``finish`` the rest, so that the
    pieces join up to ``result``: auto streams content up to the first ``<tool_call>`` (and holds
    back text that is only whitespace, which may turn out null), required holds everything back,
    named streams the arguments as they come.

    finish_reason: "tool_calls" where auto or required returned calls (vLLM's); a named function's
    is the output's own ("stop", or "length"), as OpenAI's and vLLM's."""

    def __init__(self, mode: str, name: str | None = None):
        self.mode, self.name = mode, name
        self.text = ""
        self.sent = 0  # auto: content characters sent
        self.named_id = _call_id() if mode == "named" else None
        self.header_sent = False  # named: the call's id and name sent

    @staticmethod
    def _calls(pairs, ids=None) -> list:
        return [{"id": ids[i] if ids else _call_id(), "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(pairs)]

    def result(self, text: str, finish_reason):
        """(content, tool_calls or None, finish_reason) of the whole text."""
        if self.mode == "named":
            return None, self._calls([(self.name, text)], [self.named_id]), finish_reason
        if self.mode == "required":
            pairs = parse_required(text)
            if pairs is None:
                return text, None, finish_reason
            return None, self._calls(pairs), "tool_calls" if finish_reason == "stop" else finish_reason
        content, pairs = parse_hermes(text)
        if not pairs:
            return content, None, finish_reason
        return content, self._calls(pairs), "tool_calls"

    def _header(self, arguments: str) -> dict:
        self.header_sent = True
        return {"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                "function": {"name": self.name, "arguments": arguments}}]}

    def feed(self, delta: str) -> dict:
        """The fields of the delta for a new piece of text ({} when nothing can be sent yet)."""
        if not delta:
            return {}
        self.text += delta
        if self.mode == "named":
            if not self.header_sent:
                return self._header(delta)
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}
        if self.mode == "required":
            return {}
        cut = self.text.find(TOOL_CALL_OPEN)
        safe = cut if cut >= 0 else len(self.text) - held_tail(self.text, [TOOL_CALL_OPEN])
        if safe <= self.sent or not self.text[:safe].strip():
            return {}
        piece, self.sent = self.text[self.sent:safe], safe
        return {"content": piece}

    def finish(self, text: str, finish_reason):
        """(the deltas' fields still to send, finish_reason) once the text is whole."""
        content, calls, reason = self.result(text, finish_reason)
        if self.mode == "named":
            return ([] if self.header_sent else [self._header("")]), reason
        deltas = []
        if content is not None:
            rest = content[self.sent:]
            if rest or not self.sent:
                deltas.append({"content": rest})
        for i, call in enumerate(calls or ()):
            function = call["function"]
            deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                           "function": {"name": function["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]})
        return deltas, reason
