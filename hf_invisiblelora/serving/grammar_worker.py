"""The process grammar.Grammars tries a grammar's compilation in first, run as a script (``python
grammar_worker.py MAX_BYTES``) so that it imports xgrammar alone, not this package. Lines of JSON
on stdin and stdout: first the tokenizer's ``TokenizerInfo.serialize_json()``, answered
``["ready"]``; then one grammar key (grammar.GrammarSpec.key) a line, answered ``["ok"]`` once it
compiled or ``["error", message]``. Its address space is bounded to what it held at start plus
MAX_BYTES, so a grammar that needs more fails here (or kills this process), and one that takes too
long is killed here: the server compiles only what compiled here in time. (The compiled grammar is
not sent back: xgrammar's serialized form can be hundreds of times its size, 490 MB and 50 s for a
3.5 MB grammar of 2000 rules.)"""

import json
import os
import re
import resource
import sys

MEMORY = "compiling it needs more memory than a grammar may use"


def compile_spec(compiler, kind: str, value: str):
    """One grammar key compiled; grammar.compile_spec defers to this (one definition of what each kind means).
    JSON on one line, as json.dumps writes it (", " and ": " between items, no other whitespace);
    json_object is any JSON object (OpenAI's, vLLM's)."""
    if kind == "json_schema":
        return compiler.compile_json_schema(value, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":  # JSON's string escapes are EBNF's
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(value)))
    return compiler.compile_grammar(value)


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def main() -> None:
    import xgrammar as xgr

    max_bytes = int(sys.argv[1])
    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.readline())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        limit = _address_space() + max_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (OSError, ValueError, StopIteration):
        pass
    out = os.fdopen(sys.stdout.fileno(), "w", closefd=False)
    out.write('["ready"]\n')
    out.flush()
    for line in sys.stdin:
        try:
            kind, value = json.loads(line)
            compile_spec(compiler, kind, value)
            answer = ["ok"]
        except Exception as e:  # noqa: BLE001 - xgrammar's parse and conversion errors, handed back
            text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(e).strip())  # xgrammar's time and source line
            if isinstance(e, MemoryError) or "bad_alloc" in text:  # past this process's bound (C++'s too)
                text = MEMORY
            answer = ["error", text.splitlines()[0] if text else type(e).__name__]
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
