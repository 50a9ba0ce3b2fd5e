"""Structured outputs: what a grammar's mask costs, and JSON-schema requests against free ones.

On the zoo (SmolLM2-135M-Instruct + four of its adapters), greedy. Parts:
  mask     per position: xgrammar's fill of the next-token mask along a valid JSON output (and
           llguidance's, if installed: the measurement behind the choice), and a GrammarMask call
           over a verify pass of K + 1 positions (fills kept from the draft positions reused).
  generate generate() tokens/s over batches of 4 rows on 4 adapters, every row under a JSON schema
           (xgrammar's Transformers processor) or none, stock PEFT, the default path (drafting by
           the gate) and gate="never" (no drafting); medians of repeats, configurations interleaved,
           one warm-up call each; every constrained output checked equal to stock's.
  engine   the engine (in process) with 8 requests at once: 4 free ones beside 4 other free ones,
           then beside 4 JSON-schema ones: the free ones' tokens/s, and whether their answers changed.

    python -P benchmarks/bench_structured.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora import zoo
from hf_invisiblelora.decode.grammar import GrammarMask
from hf_invisiblelora.serving.grammars import Grammars, GrammarSpec, compile_spec
from hf_invisiblelora.engine import Engine, Request

ADAPTERS = ["kjv", "shakespeare", "python_code", "humaneval"]
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "summary": {"type": "string", "maxLength": 120}}, "required": ["title", "year", "tags", "summary"],
    "additionalProperties": False}
VALID = {"title": "The Tempest", "year": 1611, "tags": ["play", "island"], "summary": "A sorcerer, his daughter and a storm."}


def median_us(f, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def part_mask(model, tok, vocab, args) -> dict:
    import xgrammar as xgr

    ids = tok(json.dumps(VALID), add_special_tokens=False).input_ids + [tok.eos_token_id]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t = time.perf_counter()
    grammar = compile_spec(compiler, GrammarSpec("json_schema", SCHEMA).key())
    out = dict(compile_ms=(time.perf_counter() - t) * 1e3, tokens=len(ids))
    matcher, bitmask, fills = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab), []
    for i in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        fills.append(time.perf_counter() - t)
        assert matcher.accept_token(i)
    out["xgrammar_fill_us_median"], out["xgrammar_fill_us_max"] = statistics.median(fills) * 1e6, max(fills) * 1e6
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        t = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(SCHEMA), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
        out["llguidance_compile_ms"] = (time.perf_counter() - t) * 1e3
        bm, fills = lt.allocate_token_bitmask(1, vocab), []
        for i in ids:
            t = time.perf_counter()
            lt.fill_next_token_bitmask(m, bm, 0)
            fills.append(time.perf_counter() - t)
            assert m.consume_token(i), m.get_error()
        out["llguidance_fill_us_median"], out["llguidance_fill_us_max"] = statistics.median(fills) * 1e6, max(fills) * 1e6
    except ImportError:
        pass
    # A verify pass of K + 1 positions, as RequestPolicy asks (one call per position, the output so far),
    # after the draft positions were asked (their masks kept), and the first time (filled then).
    k, prompt = args.num_draft_tokens, [5] * 8
    scores = torch.zeros(1, vocab)

    def verify(mask, start):
        for t in range(k + 1):
            mask(torch.tensor([prompt + ids[: start + t]]), scores)

    fresh = []
    for start in range(0, len(ids) - k - 1, k):
        m = GrammarMask(grammar, len(prompt))
        t = time.perf_counter()
        verify(m, start)
        fresh.append(time.perf_counter() - t)
    m = GrammarMask(grammar, len(prompt))
    verify(m, 10)
    out["verify_pass_us_fresh"] = statistics.median(fresh) * 1e6
    out["verify_pass_us_cached"] = median_us(lambda: verify(m, 10), 50)
    out["k"] = k
    return out


def part_generate(model, tok, vocab, args) -> dict:
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    grammar = compile_spec(xgr.GrammarCompiler(info), GrammarSpec("json_schema", SCHEMA).key())
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe a {w} as JSON with a title, a year, "
                                                                     "tags and a summary."}],
                                       tokenize=False, add_generation_prompt=True)
               for w in ("book", "play", "poem", "program")]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    configs = {"stock": {}, "default": dict(invisible_lora=True), "never": dict(invisible_lora=True, gate="never")}
    runs = {(c, g): [] for c in configs for g in ("free", "json")}
    outputs = {}

    def call(c, g):
        kwargs = dict(**enc, adapter_names=ADAPTERS, max_new_tokens=args.max_tokens, do_sample=False,
                      pad_token_id=tok.pad_token_id, **configs[c])
        if g == "json":
            kwargs["logits_processor"] = [LogitsProcessor(grammar)]
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**kwargs)
        seconds = time.perf_counter() - t
        new = out[:, enc.input_ids.shape[1]:]
        outputs[(c, g)] = new
        return int((new != tok.pad_token_id).sum()), seconds

    for key in runs:  # warm-up (the gate calibrates, as a server's first request would)
        call(*key)
    for r in range(args.repeats):
        keys = list(runs)
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            runs[key].append(call(*key))
    same = all(torch.equal(outputs[("stock", g)], outputs[(c, g)]) for c in ("default", "never") for g in ("free", "json"))
    texts = [tok.decode(row, skip_special_tokens=True) for row in outputs[("default", "json")]]
    table = {f"{c}/{g}": statistics.median(n / s for n, s in v) for (c, g), v in runs.items()}
    return dict(tokens_per_s=table, identical_to_stock=same, json_texts=texts)


def part_engine(model, tok, vocab, args) -> dict:
    prompts = [tok(t).input_ids for name in ADAPTERS for t in zoo.adapter_prompts("smollm2", tok, name, 2, 24, seed=3)]
    engine = Engine(model, max_batch=8, max_len=256).start()
    grammars = Grammars(tok, vocab_size=vocab, stop_token_ids=engine.eos_ids).start()
    grammar = grammars.compile(GrammarSpec("json_schema", SCHEMA))
    results = {}
    try:
        for mode in ("free beside free", "free beside json") * (args.repeats + 1):
            free = [engine.submit(Request(prompts[i], adapter=ADAPTERS[i % 4], max_tokens=args.max_tokens, temperature=0))
                    for i in range(4)]
            others = [engine.submit(Request(prompts[4 + i], adapter=ADAPTERS[i % 4], max_tokens=args.max_tokens,
                                            temperature=0, grammar=grammar if mode.endswith("json") else None))
                      for i in range(4)]
            t = time.perf_counter()
            answers = [h.result(600) for h in free]
            seconds = time.perf_counter() - t
            for h in others:
                h.result(600)
            entry = results.setdefault(mode, dict(rates=[], answers=answers))
            entry["rates"].append(sum(map(len, answers)) / seconds)
            entry["same"] = entry.get("same", True) and entry["answers"] == answers
    finally:
        engine.stop()
        grammars.close()
    same = results["free beside free"]["answers"] == results["free beside json"]["answers"]
    return dict({mode: statistics.median(r["rates"][1:]) for mode, r in results.items()},  # the first: warm-up
                free_answers_unchanged=same)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["mask", "generate", "engine"], choices=["mask", "generate", "engine"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/structured.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, _ = zoo.load_zoo("smollm2", ADAPTERS)
    vocab = model.get_output_embeddings().weight.shape[0]
    command = "python -P benchmarks/bench_structured.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = dict(command=command, machine=machine(), threads=torch.get_num_threads())
    print(f"{command}\n{machine()}, {torch.get_num_threads()} threads\n")
    for part in args.parts:
        result[part] = {"mask": part_mask, "generate": part_generate, "engine": part_engine}[part](model, tok, vocab, args)
        print(part, json.dumps(result[part], indent=1, default=str), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
