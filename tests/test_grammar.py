"""Structured outputs (decode/grammar.py, serving/grammars.py) decode as stock does, under speculation.

generate(): a model's greedy output with xgrammar's Transformers processor, ``invisible_lora=True``
against stock PEFT, token for token, over random JSON schemas (every output valid), regexes,
choices and EBNF grammars, per-row grammars in mixed-adapter batches; sampling draws from the
masked distribution (chi-square against exact enumeration, with a power check). The engine:
constrained, free and differently constrained requests on several adapters in one batch, each
equal to stock generate() alone. Grammars: compiled in a bounded worker, refused when invalid or
too costly, cached; a worker killed from outside started again, one crashed by its grammar refusing
it; submit's own thread and bounded queue, refusals remembered."""

import contextlib
import json
import os
import signal
import threading
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xgrammar.contrib.hf import LogitsProcessor

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.decode.grammar import GrammarMask
from hf_invisiblelora.serving.grammars import (CompilerUnavailable, GrammarError, Grammars, GrammarsBusy, GrammarSpec,
                                               compile_spec)
from hf_invisiblelora.engine import Engine, Request
from hf_invisiblelora.engine.request import Status
from tiny import chi_square_p, json_tokenizer, tiny_peft

EOS, PAD = 1, 0


@pytest.fixture(scope="module")
def tok():
    return json_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_peft("llama", vocab=len(tok), adapters=("s", "b", "c"), strength=0.6)


@pytest.fixture(scope="module")
def compiler(tok):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[EOS]))


def compiled(compiler, kind, value=None):
    return compile_spec(compiler, GrammarSpec(kind, value).key())


def both(model, grammars, ids, adapters, max_new_tokens=96, num_draft_tokens=4, **options):
    """(stock PEFT's output, ours) of the same call with xgrammar's processor (a fresh one each);
    ``options``: ours's InvisibleLoRA options besides gate="always"."""
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=adapters, max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
    with torch.no_grad():
        stock = model.generate(**call, logits_processor=[LogitsProcessor(grammars)])
        ours = model.generate(**call, logits_processor=[LogitsProcessor(grammars)], invisible_lora=True,
                              gate="always", num_draft_tokens=num_draft_tokens, return_dict_in_generate=True,
                              **options)
    return stock, ours


def outputs(tok, sequences, prompt_len):
    """Each row's text and whether it ended with EOS."""
    rows = []
    for row in sequences[:, prompt_len:].tolist():
        ended = EOS in row
        rows.append((tok.decode(row[: row.index(EOS)] if ended else row), ended))
    return rows


def prompts(n, length=6, vocab=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g)


# Random schemas whose instances are bounded (no free numbers, bounded strings, arrays and objects),
# so every output ends within its budget.
LEAVES = st.one_of(
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 200)),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.sampled_from(["x", "yz", "a b", "q\"", 7, True]), min_size=1, max_size=3, unique=True).map(
        lambda e: {"enum": e}),
)


def _objects(children):
    def build(props):
        return st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False})
    return st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3).flatmap(build)


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3)),
    _objects(children)), max_leaves=5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(SCHEMAS, min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_random_json_schemas_decode_as_stock(model, tok, compiler, schemas, seed):
    """One schema for all rows, or one per row; rows on different adapters and the base model."""
    grammars = [compiled(compiler, "json_schema", s) for s in schemas]
    n = len(grammars) if len(grammars) > 1 else 3
    ids = prompts(n, seed=seed)
    adapters = ["s", "b", "__base__"][:n]
    stock, ours = both(model, grammars if len(grammars) > 1 else grammars[0], ids, adapters)
    assert torch.equal(stock, ours.sequences)
    for i, (text, ended) in enumerate(outputs(tok, ours.sequences, ids.shape[1])):
        assert ended, text  # bounded schemas end within the budget
        # strict=False: xgrammar's JSON strings admit raw control characters, which JSON escapes
        jsonschema.validate(json.loads(text, strict=False), schemas[i if len(schemas) > 1 else 0])


@pytest.mark.parametrize("kind,value,check", [
    ("regex", r"[a-c]{2,5}-[0-9]{1,3}", lambda t: __import__("re").fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", t)),
    ("choice", ["yes", "no", "maybe so", "\"quoted\""], lambda t: t in ["yes", "no", "maybe so", "\"quoted\""]),
    ("grammar", 'root ::= "(" term ("+" term)? ")"\nterm ::= [0-9] | "(" [0-9] "*" [0-9] ")"',
     lambda t: __import__("re").fullmatch(r"\((\d|\(\d\*\d\))(\+(\d|\(\d\*\d\)))?\)", t)),
    ("json_object", None, lambda t: isinstance(json.loads(t, strict=False), dict)),
])
@pytest.mark.parametrize("k", [1, 3])
def test_regex_choice_grammar_and_json_decode_as_stock(model, tok, compiler, kind, value, check, k):
    ids = prompts(4, seed=k)
    stock, ours = both(model, compiled(compiler, kind, value), ids, ["s", "b", "c", "__base__"],
                       max_new_tokens=160 if kind == "json_object" else 48, num_draft_tokens=k)
    assert torch.equal(stock, ours.sequences)
    done = [(text, ended) for text, ended in outputs(tok, ours.sequences, ids.shape[1]) if ended]
    assert kind == "json_object" or len(done) == 4  # free JSON may run past its budget
    assert all(check(text) for text, _ in done)
    assert sum(ours.stats.drafted) > 0  # drafts were proposed and verified under the mask


def test_drafts_are_proposed_under_the_mask(model, compiler):
    """Drafts follow the grammar too: the base model's rows, drafted by the base model itself in full
    precision, accept nearly all drafts. Unmasked, a random model's drafts would fall in [a-z] (26 of
    320 tokens) about one time in ten."""
    ids = prompts(2, seed=5)
    _, ours = both(model, compiled(compiler, "regex", "[a-z]{30}"), ids, ["__base__", "__base__"], max_new_tokens=31,
                   draft_dtype=None, prompt_lookup=False)
    per = ours.stats.per_adapter["__base__"]
    assert per["acceptance"] > 0.9 and sum(ours.stats.drafted) > 20


def test_a_used_processor_or_a_changed_one_is_refused(model, compiler):
    processor = LogitsProcessor(compiled(compiler, "regex", "[a-z]+"))
    ids = prompts(1)
    model.generate(input_ids=ids, adapter_names=["s"], max_new_tokens=3, logits_processor=[processor], pad_token_id=PAD)
    with pytest.raises(ValueError, match="used by a generate"):
        model.generate(input_ids=ids, adapter_names=["s"], max_new_tokens=3, logits_processor=[processor],
                       pad_token_id=PAD, invisible_lora=True)

    class Counting(LogitsProcessor):
        def __call__(self, input_ids, scores):
            self.calls = getattr(self, "calls", 0) + 1
            return super().__call__(input_ids, scores)

    with pytest.raises(ValueError, match="changes xgrammar"):
        model.generate(input_ids=ids, adapter_names=["s"], max_new_tokens=3, pad_token_id=PAD, invisible_lora=True,
                       logits_processor=[Counting(compiled(compiler, "regex", "[a-z]+"))])


CHOICES = ["ab", "ba", "abc", "c", "bb"]


def exact(model, tok, grammar, adapter, prompt, steps=3):
    """P(the first ``steps`` tokens) under the grammar's mask (stock's processor, temperature 1), by
    enumeration; a row that ended is padded, as generate() pads it."""
    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in out.items():
            if prefix and prefix[-1] in (EOS, PAD):
                nxt[prefix + (PAD,)] = p
                continue
            matcher = xgr.GrammarMatcher(grammar)
            for t in prefix:
                assert matcher.accept_token(t)
            bitmask = xgr.allocate_token_bitmask(1, len(tok))
            matcher.fill_next_token_bitmask(bitmask)
            ids = torch.tensor([prompt + list(prefix)])
            logits = model(input_ids=ids, adapter_names=[adapter]).logits[:, -1].float()
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            probs = logits.softmax(-1)[0]
            for t in probs.nonzero()[:, 0].tolist():
                nxt[prefix + (t,)] = p * float(probs[t])
        out = nxt
    return out


def test_sampling_draws_from_the_masked_distribution(compiler, tok):
    model = tiny_peft("llama", vocab=len(tok), adapters=("b",), strength=1.5, seed=1)
    with torch.no_grad():  # peaked distributions: the adapter's and the base model's differ clearly
        model.get_output_embeddings().weight.mul_(6)
    grammar = compiled(compiler, "choice", CHOICES)
    prompt = [5, 9, 40, 7]
    with torch.no_grad():
        target = {a: exact(model, tok, grammar, a, prompt) for a in ("b", "__base__")}
        n = 1500
        torch.manual_seed(0)
        out = model.generate(input_ids=torch.tensor([prompt] * (2 * n)), adapter_names=["b"] * n + ["__base__"] * n,
                             do_sample=True, max_new_tokens=3, pad_token_id=PAD, eos_token_id=EOS,
                             logits_processor=[LogitsProcessor(grammar)], invisible_lora=True, gate="always",
                             num_draft_tokens=2, return_dict_in_generate=True)
    rows = [tuple(r) for r in out.sequences[:, len(prompt):].tolist()]
    lora, base = rows[:n], rows[n:]
    assert all(tok.decode([t for t in r if t not in (EOS, PAD)]) in [c[:len(tok.decode(r))] for c in CHOICES] for r in rows)
    assert chi_square_p(lora, target["b"]) > 1e-3
    assert chi_square_p(base, target["__base__"]) > 1e-3
    assert chi_square_p(lora, target["__base__"]) < 1e-6  # power: the adapter's masked distribution is another
    assert 0.1 < out.stats.per_adapter["b"]["acceptance"] < 0.98  # drafts were rejected and resampled


def test_mask_is_a_function_of_the_output(compiler, tok):
    """Asked in any order (drafts, then a shorter output, then a longer one), the mask equals a
    fresh matcher's after the same output; an output the grammar refuses leaves scores as they are."""
    grammar = compiled(compiler, "json_schema", {"type": "object", "properties": {"k": {"type": "string"}}})
    valid = tok('{"k": "abc"}', add_special_tokens=False).input_ids + [EOS]
    mask = GrammarMask(grammar, prompt_len=2)
    scores = torch.zeros(1, len(tok))
    for n in [3, 1, len(valid), 0, 5, 2, len(valid) - 1, 4]:
        got = mask(torch.tensor([[7, 8] + valid[:n]]), scores.clone())  # masked in place, as xgrammar's
        matcher = xgr.GrammarMatcher(grammar)
        for t in valid[:n]:
            assert matcher.accept_token(t)
        want = torch.zeros(1, len(tok))
        bitmask = xgr.allocate_token_bitmask(1, len(tok))
        if matcher.is_terminated():  # xgrammar's processor keeps the mask it had before the stop token
            matcher.rollback(1)
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(want, bitmask)
        assert torch.equal(got, want), n
    refused = tok('{"x', add_special_tokens=False).input_ids
    assert torch.equal(mask(torch.tensor([[7, 8] + refused]), scores.clone()), scores)


def test_engine_mixed_batch_decodes_as_stock(model, tok, compiler):
    """Constrained requests of every kind, and free ones, on several adapters at once: each equals
    stock generate() alone with its grammar (the engine's stop tokens end the grammar)."""
    specs = [("json_schema", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                 "s": {"enum": ["x", "y"]}}, "required": ["n", "s"]}),
             ("regex", r"[a-z]{3}\.[0-9]{2}"), ("choice", ["alpha", "beta", "gamma"]),
             ("grammar", 'root ::= "<" [a-f]+ ">"'), (None, None), (None, None)]
    adapters = ["s", "b", "c", "__base__", "s", "b"]
    engine = Engine(model, max_batch=6, max_len=160, num_draft_tokens=3).start()
    try:
        eos = engine.eos_ids
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=eos)
        engine_compiler = xgr.GrammarCompiler(info)
        grammars = [None if kind is None else compiled(engine_compiler, kind, value) for kind, value in specs]
        ids = prompts(len(specs), length=5, seed=3).tolist()
        handles = [engine.submit(Request(p, adapter=a, max_tokens=40, temperature=0, grammar=g))
                   for p, a, g in zip(ids, adapters, grammars)]
        got = [h.result(120) for h in handles]
    finally:
        engine.stop()
    for p, a, g, out in zip(ids, adapters, grammars, got):
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor([p]), adapter_names=[a], max_new_tokens=40, do_sample=False,
                                 eos_token_id=eos, pad_token_id=PAD,
                                 logits_processor=[LogitsProcessor(g)] if g is not None else None)
        assert out == ref[0, len(p):].tolist(), (a, g)
    assert tok.decode(got[2][:-1]) in ["alpha", "beta", "gamma"] and got[2][-1] in eos


def test_engine_constrained_requests_joining_mid_decode(model, tok):
    """Constrained requests that join while others decode: a short prompt folded into a verify pass,
    a long one prefilled in chunks between cycles, and a prompt found in the prefix cache; each equals
    stock generate() alone with its grammar."""
    engine = Engine(model, max_batch=4, max_len=200, num_draft_tokens=3, prefill_chunk=16).start()
    try:
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=engine.eos_ids)
        c = xgr.GrammarCompiler(info)
        grammar = compiled(c, "json_schema", {"type": "object", "properties": {
            "k": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 4}, "n": {"type": "boolean"}},
            "required": ["k", "n"], "additionalProperties": False})
        regex = compiled(c, "regex", r"[a-d]{2,4}(, [a-d]{2,4}){0,3}")
        g = torch.Generator().manual_seed(4)
        long = torch.randint(2, len(tok), (70,), generator=g).tolist()  # 5 chunks of 16
        shared = torch.randint(2, len(tok), (40,), generator=g).tolist()  # two full blocks
        busy = [engine.submit(Request(torch.randint(2, len(tok), (6,), generator=g).tolist(), adapter=a,
                                      max_tokens=150, temperature=0, ignore_eos=True)) for a in ("s", "b")]
        first = engine.submit(Request(shared, adapter="c", max_tokens=40, temperature=0, grammar=grammar)).result(60)
        joining = [(shared, "c", grammar), ([9, 4, 7], "s", regex), (long, "b", grammar)]
        handles = [engine.submit(Request(p, adapter=a, max_tokens=40, temperature=0, grammar=gr)) for p, a, gr in joining]
        got = [h.result(120) for h in handles]
        assert all(h.status != Status.FINISHED for h in busy)  # they joined rows that were decoding
        for h in busy:
            h.result(120)
        hits = engine.metrics_snapshot()["prefix_hits"]
    finally:
        engine.stop()
    assert got[0] == first and hits >= 32  # the shared prompt's blocks were found
    for (p, a, gr), out in zip(joining, got):
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor([p]), adapter_names=[a], max_new_tokens=40, do_sample=False,
                                 eos_token_id=engine.eos_ids, pad_token_id=PAD, logits_processor=[LogitsProcessor(gr)])
        assert out == ref[0, len(p):].tolist(), a


def test_engine_refuses_min_tokens_with_a_grammar(model, tok, compiler):
    """Where a grammar ends only stop tokens are allowed, which min_tokens blocks."""
    engine = Engine(model, max_batch=2, max_len=64)
    with pytest.raises(ValueError, match="min_tokens") as e:
        engine.validate(Request([5, 6], adapter="s", min_tokens=3, grammar=compiled(compiler, "choice", ["a"])))
    assert e.value.param == "min_tokens"


def test_engine_seeded_sampling_under_a_grammar_does_not_depend_on_the_batch(model, tok):
    engine = Engine(model, max_batch=4, max_len=96, num_draft_tokens=2).start()
    try:
        grammars = Grammars(tok, vocab_size=len(tok), stop_token_ids=engine.eos_ids)
        grammar = grammars.compile(GrammarSpec("regex", "[a-z]{1,8}( [a-z]{1,8}){0,3}"))
        prompt = prompts(1, seed=9).tolist()[0]
        alone = engine.submit(Request(prompt, adapter="b", max_tokens=40, temperature=1.0, seed=11, grammar=grammar)).result(60)
        crowd = [engine.submit(Request(prompt, adapter=a, max_tokens=40, temperature=1.0, seed=11 if a == "b" else 5,
                                       grammar=grammar if a != "c" else None)) for a in ("s", "b", "c", "__base__")]
        together = [h.result(60) for h in crowd]
    finally:
        engine.stop()
        grammars.close()
    assert together[1] == alone
    import re
    assert re.fullmatch("[a-z]{1,8}( [a-z]{1,8}){0,3}", tok.decode(alone[:-1])), tok.decode(alone)


def test_grammars_are_validated_bounded_and_cached(tok):
    grammars = Grammars(tok, vocab_size=len(tok), stop_token_ids=[EOS], timeout=2.0).start()
    try:
        first = grammars.compile(GrammarSpec("json_schema", {"type": "object"}))
        assert grammars.compile(GrammarSpec("json_schema", '{"type":  "object"}')) is first  # the same schema
        for spec, message in [(GrammarSpec("json_schema", "{not json"), "not JSON"),
                              (GrammarSpec("json_schema", {"type": "no-such-type"}), "invalid json_schema"),
                              (GrammarSpec("regex", "[a-"), "invalid regex"),
                              (GrammarSpec("grammar", "root ::= undefined_rule"), "invalid grammar"),
                              (GrammarSpec("choice", []), "non-empty"),
                              (GrammarSpec("regex", "a" * 70000), "at most"),
                              (GrammarSpec("nonsense", "x"), "unknown grammar kind"),
                              (GrammarSpec("json_schema", "[" * 60000), "deeper than"),
                              (GrammarSpec("json_schema", '{"items":' * 200 + "{}" + "}" * 200), "deeper than")]:
            with pytest.raises(GrammarError, match=message):
                grammars.compile(spec)
        # 2000 rules: 0.1 s on this 320-token vocabulary (measured), seconds on a real one's
        rules = "\n".join(["root ::= r0"] + [f'r{i} ::= "x{i}" r{i + 1} | [a-z]' for i in range(2000)] + ['r2000 ::= "e"'])
        grammars.timeout = 0.02
        start = time.perf_counter()
        with pytest.raises(GrammarError, match="longer than"):
            grammars.compile(GrammarSpec("grammar", rules))
        assert time.perf_counter() - start < 1  # the compilation's process was killed, not waited for
        grammars.timeout = 10
        assert grammars.compile(GrammarSpec("regex", "[0-9]+")) is not None  # a new process serves on
        assert grammars.compile(GrammarSpec("grammar", rules)) is not None  # given the time, it compiles
        grammars.max_bytes = 1 << 20
        grammars.close()  # the next process starts with the new bound
        with pytest.raises(GrammarError, match="memory"):
            grammars.compile(GrammarSpec("grammar", rules + "\n"))  # not the cached one
    finally:
        grammars.close()


def chain(n: int, tag: str = "") -> str:
    """An EBNF grammar whose compilation grows with the square of ``n`` (a chain of rules that may be
    empty): on this 320-token vocabulary about 0.2 s at 600 in the worker, 1.6 s at 1400."""
    rules = [f"r{i} ::= [a-z]* r{i + 1} | [0-9]+ r{i + 1}" for i in range(n)]
    return "\n".join(["root ::= r0", *rules, f'r{n} ::= "e{tag}"'])


def kill_worker(grammars, sig=signal.SIGKILL, *, after: float = 0.0, starting: bool = False):
    """A thread sending ``sig`` to the grammar worker ``after`` seconds from now (``starting``: to the
    next worker as soon as it exists, while it starts); joined by the caller."""
    def run():
        old = grammars._process
        if starting:
            while grammars._process is old or grammars._process is None:
                time.sleep(0.005)
        time.sleep(after)
        os.kill(grammars._process.pid, sig)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_dead_worker_is_started_again(tok, caplog):
    """A worker killed from outside (SIGKILL, SIGTERM) while idle, while compiling or while starting
    is not the grammar's fault: a new one starts and the grammar compiles (it was refused as needing
    too much memory, or a BrokenPipeError escaped); the warnings say each kill landed."""
    grammars = Grammars(tok, vocab_size=len(tok), stop_token_ids=[EOS], timeout=30).start()
    try:
        for n, sig in enumerate((signal.SIGKILL, signal.SIGTERM)):  # idle
            kill_worker(grammars, sig).join()
            assert grammars.compile(GrammarSpec("regex", f"[0-9]+x{n}")) is not None
        thread = kill_worker(grammars, after=0.4)  # while compiling (1.6 s there)
        assert grammars.compile(GrammarSpec("grammar", chain(1400))) is not None
        thread.join()
        grammars.close()
        thread = kill_worker(grammars, starting=True)  # while starting (importing xgrammar: seconds)
        assert grammars.compile(GrammarSpec("regex", "[a-c]+")) is not None
        thread.join()
    finally:
        grammars.close()
    warnings = [r.getMessage() for r in caplog.records if "grammar compiler's process" in r.getMessage()]
    assert sum("(SIGKILL)" in w for w in warnings) == 3 and sum("(SIGTERM)" in w for w in warnings) == 1, warnings
    assert sum("ended (SIGKILL) before its answer" in w for w in warnings) >= 1, warnings  # mid-compile
    assert sum("ended while starting (SIGKILL)" in w for w in warnings) == 1, warnings


def test_a_crash_is_the_grammars_and_a_worker_that_cannot_live_is_not(tok):
    """A worker that dies of its own signal while compiling (SIGABRT, as a crash; SIGSEGV has a native
    handler there that can hang) refuses the grammar, and a repeat is refused at once (remembered, no
    worker asked); a worker killed each time it starts makes CompilerUnavailable, never the grammar's
    GrammarError."""
    grammars = Grammars(tok, vocab_size=len(tok), stop_token_ids=[EOS], timeout=30).start()
    try:
        spec = GrammarSpec("grammar", chain(1400, "crash"))
        thread = kill_worker(grammars, signal.SIGABRT, after=0.4)
        with pytest.raises(GrammarError, match=r"crashed the grammar compiler \(SIGABRT: past the memory"):
            grammars.compile(spec)
        thread.join()
        start = time.perf_counter()
        with pytest.raises(GrammarError, match="crashed"):
            grammars.compile(spec)
        assert time.perf_counter() - start < 0.1 and grammars._process is None  # not compiled again
        stop = threading.Event()

        def kill_each():
            while not stop.is_set():
                process = grammars._process
                if process is not None and process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGKILL)
                time.sleep(0.005)

        killer = threading.Thread(target=kill_each)
        killer.start()
        try:
            with pytest.raises(CompilerUnavailable):
                grammars.compile(GrammarSpec("regex", "[0-9]{3}"))
        finally:
            stop.set()
            killer.join()
        assert grammars.compile(GrammarSpec("regex", "[0-9]{3}")) is not None  # not refused: served now
    finally:
        grammars.close()


def test_submit_waits_apart_bounded_shared_and_remembers_refusals(tok):
    """Grammars.submit compiles on the compiler's own thread: the callers of a grammar share its
    Future; past max_pending waiting grammars another is GrammarsBusy at once, while a compiled one
    is answered at once; a refused grammar is refused at once the next time (remembered), and tried
    again once the bounds are looser."""
    grammars = Grammars(tok, vocab_size=len(tok), stop_token_ids=[EOS], timeout=0.5, max_pending=1).start()
    try:
        digits = grammars.compile(GrammarSpec("regex", "[0-9]+"))
        slow = GrammarSpec("grammar", chain(1400, "submit"))  # 1.6 s there
        future = grammars.submit(slow)
        assert grammars.submit(slow) is future
        with pytest.raises(GrammarsBusy):
            grammars.submit(GrammarSpec("regex", "[a-z]+"))
        done = grammars.submit(GrammarSpec("regex", "[0-9]+"))
        assert done.done() and done.result() is digits and not future.done()
        with pytest.raises(GrammarError, match="longer than 0.5 s"):
            future.result(60)
        start = time.perf_counter()
        with pytest.raises(GrammarError, match="longer than 0.5 s"):
            grammars.submit(slow)
        assert time.perf_counter() - start < 0.1
        assert grammars.submit(GrammarSpec("regex", "[a-z]+")).result(60) is not None  # room again
        grammars.timeout = 30
        assert grammars.submit(slow).result(60) is not None
    finally:
        grammars.close()
