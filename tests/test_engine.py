"""The continuous-batching engine: each request decodes as standalone generate() of its prompt with
its adapter (float64, greedy), whatever shares the batch; seeded sampling is reproducible per
request and exact; rows are freed by cancellation; adapters load and unload while serving."""

import dataclasses
import threading
import time

import pytest
import torch
from peft import LoraConfig

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.decode.batch import Phase
from hf_invisiblelora.engine import Engine, InvalidRequest, Request
from hf_invisiblelora.lora import layer as lora_layer
from tiny import chi_square_p, tiny_peft

NAMES = ["s", "b", "__base__", "c", "d"]


def standalone(model, prompt, adapter, max_tokens, **kw):
    out = model.generate(input_ids=torch.tensor([prompt]), adapter_names=[adapter], max_new_tokens=max_tokens,
                         do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def random_prompt(g, n, vocab=64):
    return torch.randint(2, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_peft("llama", strength=0.6)


@pytest.mark.parametrize("k, gate", [(2, "always"), (4, "auto"), (0, "never")])
def test_requests_decode_as_standalone_generate(model, k, gate):
    """More requests than rows, of different lengths and budgets, arriving while others decode."""
    g = torch.Generator().manual_seed(k)
    engine = Engine(model, max_batch=3, max_len=64, num_draft_tokens=k, gate=gate).start()
    try:
        jobs = []
        for i in range(11):
            prompt, name = random_prompt(g, 1 + i % 6), NAMES[i % 5]
            jobs.append((prompt, name, engine.submit(Request(prompt, adapter=name, max_tokens=3 + i % 7, temperature=0))))
        for prompt, name, handle in jobs:
            out = handle.result(120)
            assert out == standalone(model, prompt, name, handle.request.max_tokens), (prompt, name)
            assert handle.finish_reason == "length"
    finally:
        engine.stop()
    assert engine.running() == 0 and engine.metrics["requests"] == 11


@pytest.mark.parametrize("options", [dict(draft_vocab=[7]), dict(draft_dtype=torch.bfloat16),
                                     dict(draft_vocab=24, draft_dtype=torch.bfloat16), dict(draft_dtype=torch.int4)])
def test_drafter_options_keep_the_output(model, options):
    """The engine's drafter takes generate()'s options (the same assembly, session.py): output as
    standalone generate(); a vocabulary of one token no request emits gets no draft accepted."""
    g = torch.Generator().manual_seed(3)
    jobs = [(random_prompt(g, 2 + i), NAMES[i % 4]) for i in range(4)]
    expected = [standalone(model, p, a, 6) for p, a in jobs]
    if options.get("draft_vocab") == [7]:
        assert all(7 not in e for e in expected)
    if isinstance(options.get("draft_vocab"), int):  # the most frequent tokens of earlier calls
        with pytest.raises(ValueError, match="there were none"):
            Engine(tiny_peft("llama", strength=0.6), **options)
        p, a = jobs[0]
        model.generate(input_ids=torch.tensor([p]), adapter_names=[a], max_new_tokens=6, invisible_lora=True)
    # Prompt lookup off: the base model drafts alone (its restricted vocabulary's drafts are judged here).
    engine = Engine(model, max_batch=4, max_len=64, num_draft_tokens=2, gate="always", prompt_lookup=False,
                    **options).start()
    try:
        handles = [engine.submit(Request(p, adapter=a, max_tokens=6, temperature=0)) for p, a in jobs]
        assert [h.result(60) for h in handles] == expected
        m = engine.metrics_snapshot()
    finally:
        engine.stop()
    assert sum(m["drafted"].values()) > 0
    assert (sum(m["accepted"].values()) == 0) == (options.get("draft_vocab") == [7])


def test_a_request_state_follows_it(model):
    """A Handle's status and row: waiting in the queue, decoding in a row (seen by its own chunks),
    finished with no row; a second request waits while the only row is taken."""
    from hf_invisiblelora.engine import Status

    g = torch.Generator().manual_seed(9)
    engine = Engine(model, max_batch=1, max_len=64, num_draft_tokens=2, gate="always").start()
    seen, handles = [], []

    def on_tokens(tokens):
        first, second = handles
        seen.append((first.status, first.row, second.status, second.row))

    try:
        with engine._wake:  # both queued before the engine's next admission
            handles.append(engine.submit(Request(random_prompt(g, 4), max_tokens=5, temperature=0, on_tokens=on_tokens)))
            handles.append(engine.submit(Request(random_prompt(g, 3), max_tokens=4, temperature=0)))
            assert [h.status for h in handles] == [Status.WAITING, Status.WAITING]
        for h in handles:
            h.result(60)
    finally:
        engine.stop()
    assert seen and all(s == (Status.DECODING, 0, Status.WAITING, None) for s in seen)
    assert [(h.status, h.row, h.finish_reason) for h in handles] == [(Status.FINISHED, None, "length")] * 2


def test_eos_finishes_a_request_early(model):
    g = torch.Generator().manual_seed(5)
    prompt = random_prompt(g, 4)
    free = standalone(model, prompt, "b", 12)
    at = next(i for i in range(2, 12) if free[i] not in free[:i])  # a token the request first produces there
    eos_model = tiny_peft("llama", strength=0.6)
    eos_model.generation_config.eos_token_id = free[at]
    expected = standalone(eos_model, prompt, "b", 12)
    assert expected == free[: at + 1]
    engine = Engine(eos_model, max_batch=2, max_len=64, num_draft_tokens=3, gate="always").start()
    try:
        handle = engine.submit(Request(prompt, adapter="b", max_tokens=12, temperature=0))
        assert handle.result(60) == expected and handle.finish_reason == "stop"
    finally:
        engine.stop()


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    g = torch.Generator().manual_seed(1)
    prompt = random_prompt(g, 5)
    request = dict(adapter="d", max_tokens=10, temperature=0.8, top_k=20, seed=42)
    alone = Engine(model, max_batch=4, max_len=64, num_draft_tokens=3, gate="always").start()
    try:
        first = alone.submit(Request(prompt, **request)).result(60)
    finally:
        alone.stop()
    busy = Engine(model, max_batch=4, max_len=64, num_draft_tokens=1, gate="auto").start()
    try:
        others = [busy.submit(Request(random_prompt(g, 3 + i), adapter=NAMES[i], max_tokens=8, temperature=1.0))
                  for i in range(3)]
        again = busy.submit(Request(prompt, **request)).result(60)
        [h.result(60) for h in others]
        other_seed = busy.submit(Request(prompt, **{**request, "seed": 7})).result(60)
    finally:
        busy.stop()
    assert first == again
    assert other_seed != first  # the seed matters


def exact_first_tokens(model, prompt, adapter, temperature, top_k, steps=2, min_p=0.0, repetition_penalty=1.0):
    """P(first ``steps`` tokens) under generate()'s processing (repetition penalty, temperature,
    top-k, min-p), by enumeration."""
    from transformers.generation import logits_process as lp

    warpers = [lp.TemperatureLogitsWarper(temperature), lp.TopKLogitsWarper(top_k)]
    if repetition_penalty != 1.0:
        warpers.insert(0, lp.RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if min_p:
        warpers.append(lp.MinPLogitsWarper(min_p))
    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in out.items():
            ids = torch.tensor([prompt + list(prefix)])
            with torch.no_grad():
                scores = model(input_ids=ids, adapter_names=[adapter]).logits[:, -1].float()
            for w in warpers:
                scores = w(ids, scores)
            probs = scores.softmax(-1)[0]
            for t in probs.nonzero()[:, 0].tolist():
                nxt[prefix + (t,)] = p * float(probs[t])
        out = nxt
    return out


def test_sampling_follows_the_target_distribution():
    """Gumbel-max sampling with drafts (k = 2) gives generate()'s distribution; the test has power."""
    model = tiny_peft("llama", vocab=8, adapters=("b", "d"), strength=1.5, seed=1)
    prompt, n = [5, 2, 7, 3], 600
    target = exact_first_tokens(model, prompt, "b", 0.8, 3)
    engine = Engine(model, max_batch=16, max_len=32, num_draft_tokens=2, gate="always").start()
    try:
        handles = [engine.submit(Request(prompt, adapter="b", max_tokens=3, temperature=0.8, top_k=3, seed=s))
                   for s in range(n)]
        samples = [tuple(h.result(120)[:2]) for h in handles]
    finally:
        engine.stop()
    assert chi_square_p(samples, target) > 1e-3
    assert chi_square_p(samples, exact_first_tokens(model, prompt, "__base__", 0.8, 3)) < 1e-6
    assert 0 < sum(h.accepted for h in handles) < sum(h.drafted for h in handles)  # drafts were judged


def test_min_p_and_repetition_penalty_follow_the_target_distribution():
    """Sampling with repetition_penalty and min_p (k = 2 drafts): generate()'s distribution with them;
    without them it is told apart (the test has power)."""
    model = tiny_peft("llama", vocab=8, adapters=("b", "d"), strength=1.5, seed=1)
    prompt, n = [5, 2, 7, 3], 600
    opts = dict(min_p=0.2, repetition_penalty=1.8)  # and ignore_eos: the enumeration goes on past EOS
    target = exact_first_tokens(model, prompt, "b", 0.1, 8, **opts)  # this model's logits are flat: a low temperature
    engine = Engine(model, max_batch=16, max_len=32, num_draft_tokens=2, gate="always").start()
    try:
        handles = [engine.submit(Request(prompt, adapter="b", max_tokens=3, temperature=0.1, seed=s, ignore_eos=True,
                                         **opts)) for s in range(n)]
        samples = [tuple(h.result(120)[:2]) for h in handles]
    finally:
        engine.stop()
    assert chi_square_p(samples, target) > 1e-3
    for without in ("min_p", "repetition_penalty"):  # each option shows
        others = {k: v for k, v in opts.items() if k != without}
        assert chi_square_p(samples, exact_first_tokens(model, prompt, "b", 0.1, 8, **others)) < 1e-6, without


def test_cancel_frees_the_row(model):
    g = torch.Generator().manual_seed(3)
    engine = Engine(model, max_batch=1, max_len=200, num_draft_tokens=2, gate="always").start()
    try:
        stopped = threading.Event()

        def stop_after_first(tokens):
            stopped.set()
            return False

        long = engine.submit(Request(random_prompt(g, 3), adapter="s", max_tokens=150, temperature=0,
                                     on_tokens=stop_after_first))
        waiting = engine.submit(Request(random_prompt(g, 3), adapter="b", max_tokens=4, temperature=0))
        assert stopped.wait(60)
        long.cancel()
        assert waiting.result(60) and waiting.finish_reason == "length"  # got the row
        assert long.finish_reason == "cancelled" and len(long.tokens) < 150
    finally:
        engine.stop()


def test_on_tokens_can_stop_a_request(model):
    g = torch.Generator().manual_seed(4)
    engine = Engine(model, max_batch=2, max_len=64, num_draft_tokens=2, gate="always").start()
    try:
        handle = engine.submit(Request(random_prompt(g, 3), adapter="c", max_tokens=30, temperature=0,
                                       on_tokens=lambda tokens: True))
        assert handle.result(60) and handle.finish_reason == "stop" and len(handle.tokens) <= 3
    finally:
        engine.stop()


def test_bad_requests_are_refused(model):
    engine = Engine(model, max_batch=2, max_len=32, num_draft_tokens=2)
    for kw, message in [(dict(adapter="nope"), "Unknown adapter"), (dict(max_tokens=-1), "max_tokens"),
                        (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                        (dict(max_tokens=40), "longer than this server allows")]:
        with pytest.raises(ValueError, match=message):
            engine.submit(Request([3, 4, 5], **kw))
    # Each value is checked here once (the server checks only its JSON types) and the error names its field.
    for kw in [dict(temperature=float("nan")), dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0),
               dict(repetition_penalty=0.0), dict(min_tokens=-1), dict(logprobs=21), dict(stop_token_ids=[64]),
               dict(seed=2**64), dict(max_tokens="x"), dict(stop_token_ids=[1.5])]:
        with pytest.raises(InvalidRequest) as e:
            engine.submit(Request([3, 4, 5], **kw))
        assert e.value.param == next(iter(kw)), kw
    with pytest.raises(ValueError, match="empty"):
        engine.submit(Request([]))


def test_adapters_load_and_unload_while_serving(tmp_path):
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    donor = tiny_peft("llama", adapters=("d",), strength=0.6, seed=5)
    donor.save_pretrained(tmp_path)
    path = tmp_path / "d" if (tmp_path / "d").exists() else tmp_path
    g = torch.Generator().manual_seed(6)
    engine = Engine(model, max_batch=2, max_len=64, num_draft_tokens=2, gate="always").start()
    try:
        busy = engine.submit(Request(random_prompt(g, 3), adapter="s", max_tokens=40, temperature=0))
        engine.load_adapter("new", str(path))
        prompt = random_prompt(g, 4)
        out = engine.submit(Request(prompt, adapter="new", max_tokens=6, temperature=0)).result(60)
        assert out == standalone(model, prompt, "new", 6)
        assert busy.result(60) and busy.finish_reason == "length"
        long = engine.submit(Request(prompt, adapter="new", max_tokens=50, temperature=0))
        with pytest.raises(RuntimeError, match="in use"):
            engine.unload_adapter("new")
        long.result(60)
        engine.unload_adapter("new")
        assert "new" not in engine.adapters()
        with pytest.raises(ValueError, match="Unknown adapter"):
            engine.submit(Request(prompt, adapter="new"))
        again = random_prompt(g, 5)
        assert engine.submit(Request(again, adapter="b", max_tokens=5, temperature=0)).result(60) == \
            standalone(model, again, "b", 5)
    finally:
        engine.stop()


@pytest.mark.parametrize("bad", [dict(gate="alway"), dict(num_draft_tokens=-1), dict(draft_vocab="many"),
                                 dict(prepack="yes"), dict(max_lora_rank=0)])
def test_unknown_option_values_are_refused_by_name(model, bad):
    """The engine checks its options as generate() does (an unknown gate ran the auto gate before)."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        Engine(model, **bad)


def test_faults_stay_with_their_request(model, tmp_path):
    """A failing on_tokens callback ends only its request; bad token ids and types are refused up
    front; the last adapter and an adapter the engine cannot serve are refused (and rolled back)."""
    from peft import get_peft_model

    from hf_invisiblelora.engine import QueueFull
    from tiny import ARCHS

    g = torch.Generator().manual_seed(8)
    engine = Engine(model, max_batch=2, max_len=128, num_draft_tokens=2, gate="always", max_queue=2)
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit(Request([3, 4]))
    engine.start()
    try:
        def boom(tokens):
            raise KeyError("client gone")

        bad = engine.submit(Request(random_prompt(g, 3), adapter="s", max_tokens=8, temperature=0, on_tokens=boom))
        good = engine.submit(Request(random_prompt(g, 3), adapter="b", max_tokens=8, temperature=0))
        assert bad.result(60) is not None and bad.finish_reason == "error" and "client gone" in bad.error
        assert good.result(60) and good.finish_reason == "length"
        assert engine.alive
        with pytest.raises(ValueError, match=r"token id 99, which is out of vocabulary \(token ids are in \[0, 64\)"):
            engine.submit(Request([3, 99]))
        with pytest.raises(InvalidRequest, match="top_k must be an integer") as e:
            engine.submit(Request([3, 4], top_k=2.5))
        assert e.value.param == "top_k"
        request = Request([3, 4], temperature=1, max_tokens=2)  # an int temperature is a number too
        assert engine.submit(request).result(60) and isinstance(request.temperature, float)

        alora = get_peft_model(ARCHS["llama"](64).double(),
                               LoraConfig(r=4, target_modules=["q_proj"], alora_invocation_tokens=[5]),
                               adapter_name="alora")
        alora.save_pretrained(tmp_path)
        with pytest.raises(ValueError, match="variants"):
            engine.load_adapter("alora", str(tmp_path / "alora" if (tmp_path / "alora").exists() else tmp_path))
        assert "alora" not in engine.adapters() and engine.alive

        held = [engine.submit(Request(random_prompt(g, 3), adapter="s", max_tokens=100, temperature=0))
                for _ in range(2)]
        while engine.running() < 2:  # both rows taken
            time.sleep(0.01)
        held += [engine.submit(Request(random_prompt(g, 3), max_tokens=100, temperature=0)) for _ in range(2)]
        with pytest.raises(QueueFull):
            engine.submit(Request(random_prompt(g, 3), max_tokens=100, temperature=0))
    finally:
        engine.stop()
    assert all(h.done.is_set() for h in held)  # stop() finishes what was in flight
    assert {h.finish_reason for h in held} <= {"length", "cancelled"}


def test_the_last_adapter_stays():
    model = tiny_peft("llama", adapters=("s",), strength=0.6)
    engine = Engine(model, max_batch=1, max_len=32).start()
    try:
        with pytest.raises(RuntimeError, match="last adapter"):
            engine.unload_adapter("s")
        assert engine.alive and engine.adapters() == ["s"]
    finally:
        engine.stop()


def test_unloading_an_unknown_adapter_is_refused():
    """The engine runs commands outside the lock that adapters() takes (a refusal that lists the
    loaded adapters used to deadlock the engine's thread); the engine serves on."""
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    engine = Engine(model, max_batch=1, max_len=32).start()
    try:
        with pytest.raises(ValueError, match="No adapter named 'zzz'"):
            engine.unload_adapter("zzz", timeout=30)
        assert engine.alive and engine.adapters() == ["s", "b"]
        assert engine.submit(Request([3, 4], adapter="b", max_tokens=2, temperature=0)).result(30)
    finally:
        engine.stop()


def quiet(engine, timeout=30):
    """Wait until the engine holds no request; then its rows are all free and their state dropped."""
    deadline = time.monotonic() + timeout
    while engine.running() or engine.queue_length():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.005)
    decoder = engine._decoder
    assert all(row.phase is Phase.FREE for row in decoder.rows)
    assert decoder.names == [None] * engine.limits.max_batch
    assert decoder.policy.rows == [None] * engine.limits.max_batch
    assert engine._rows.handles == [None] * engine.limits.max_batch


def test_requests_admitted_together_fit_their_rows(model, monkeypatch):
    """Regression: a long prompt with a short budget and a short prompt with a long budget (each
    valid) admitted in the same cycle were left-padded together; the short one's padded width +
    max_tokens + K + 1 overflowed max_len (an IndexError in the layout) and the engine's thread
    died: both failed and every later submit raised NotRunning. Now they are prefilled in groups
    whose rows fit; one that fits beside the long prompt joins its group."""
    from hf_invisiblelora.decode.decoder import Decoder

    groups = []
    admit = Decoder.admit

    def spy(self, idx, *args, **kw):
        groups.append(list(idx))
        return admit(self, idx, *args, **kw)

    monkeypatch.setattr(Decoder, "admit", spy)
    g = torch.Generator().manual_seed(9)
    engine = Engine(model, max_batch=4, max_len=64, num_draft_tokens=4, gate="always").start()
    try:
        limit = engine.max_request_tokens  # 64 - 4 - 1
        jobs = [(random_prompt(g, 50), "s", 5), (random_prompt(g, 2), "b", limit - 2), (random_prompt(g, 3), "c", 6)]
        with engine._wake:  # queued together: admitted in one cycle
            handles = [engine.submit(Request(p, adapter=a, max_tokens=m, temperature=0)) for p, a, m in jobs]
        for (prompt, name, m), h in zip(jobs, handles):
            assert h.result(120) == standalone(model, prompt, name, m) and h.error is None
        assert groups == [[0, 2], [1]]  # the fewest groups, in FIFO order of their first request
        assert engine.alive and engine.metrics["failed_cycles"] == 0
        prompt = random_prompt(g, 4)
        assert engine.submit(Request(prompt, adapter="d", max_tokens=7, temperature=0)).result(60) == \
            standalone(model, prompt, "d", 7)
        quiet(engine)
    finally:
        engine.stop()


def test_a_failing_step_ends_only_its_requests(model, monkeypatch, caplog):
    """An unexpected exception in a prefill ends the requests of that prefill, one in a cycle the
    requests in that cycle, one in a delivery that request: each with "error", logged and counted;
    the rows are freed and reset, the other requests go on, and later requests decode exactly."""
    import logging

    from hf_invisiblelora.decode import decoder as decoding
    from hf_invisiblelora.engine import engine as engine_module
    from hf_invisiblelora.model import layout

    armed = set()

    def once(stage, fn, when=lambda *a, **kw: True):
        def wrapper(*args, **kw):
            if stage in armed and when(*args, **kw):
                armed.discard(stage)
                raise RuntimeError(f"injected {stage} failure")
            return fn(*args, **kw)
        return wrapper

    monkeypatch.setattr(layout.RowLayout, "load", once("prefill", layout.RowLayout.load))
    monkeypatch.setattr(decoding, "verify", once("cycle", decoding.verify, lambda fwd, rows, *a: len(rows.active) == 2))
    monkeypatch.setattr(engine_module.Handle, "_finish",
                        once("finish", engine_module.Handle._finish, lambda h, *a: h.request.max_tokens == 3))

    reached, release = {0: threading.Event(), 2: threading.Event()}, {0: threading.Event(), 2: threading.Event()}
    chunks = []

    def pause(tokens):  # A's callback holds the engine's thread at its chunks 0 and 2
        i = len(chunks)
        chunks.append(tokens)
        if i in reached:
            reached[i].set()
            assert release[i].wait(60)
        return False

    g = torch.Generator().manual_seed(10)
    prompts = [random_prompt(g, n) for n in (3, 5, 4, 6, 2, 7)]
    engine = Engine(model, max_batch=3, max_len=64, num_draft_tokens=2, gate="always").start()
    try:
        with caplog.at_level(logging.ERROR, logger="hf_invisiblelora"):
            a = engine.submit(Request(prompts[0], adapter="s", max_tokens=40, temperature=0, on_tokens=pause))
            assert reached[0].wait(60)
            armed.add("prefill")
            b = engine.submit(Request(prompts[1], adapter="b", max_tokens=10, temperature=0))
            release[0].set()
            assert b.result(60) == [] and b.finish_reason == "error" and "prefill" in b.error and "injected" in b.error
            assert reached[2].wait(60)  # A is still decoding
            armed.add("cycle")
            c = engine.submit(Request(prompts[2], adapter="__base__", max_tokens=30, temperature=0.8, seed=3))
            release[2].set()
            for h in (a, c):  # both were in the cycle that failed
                h.result(60)
                assert h.finish_reason == "error" and "decoding" in h.error
            assert a.tokens == standalone(model, prompts[0], "s", 40)[: len(a.tokens)] and len(a.tokens) < 40
            assert not armed
            armed.add("finish")
            d = engine.submit(Request(prompts[3], adapter="c", max_tokens=3, temperature=0))
            e = engine.submit(Request(prompts[4], adapter="d", max_tokens=9, temperature=0))
            assert d.result(60) == standalone(model, prompts[3], "c", 3) and d.finish_reason == "error"
            assert "delivery" in d.error
            assert e.result(60) == standalone(model, prompts[4], "d", 9) and e.finish_reason == "length"
        logged = [r for r in caplog.records if "failed;" in r.getMessage()]
        assert [r.getMessage().split(" failed")[0].split()[-1] for r in logged] == ["prefill", "decoding", "delivery"]
        assert all(r.exc_info for r in logged)  # with the traceback
        assert engine.alive
        m = engine.metrics_snapshot()
        assert m["failed_cycles"] == 3 and m["failed_requests"] == 4  # B; A and C; D
        quiet(engine)
        # The failed rows start afresh: every row, with every kind of request, decodes exactly.
        jobs = [(prompts[i % 6], NAMES[i % 5], 4 + i) for i in range(5)]
        handles = [engine.submit(Request(p, adapter=n, max_tokens=t, temperature=0)) for p, n, t in jobs]
        for (p, n, t), h in zip(jobs, handles):
            assert h.result(60) == standalone(model, p, n, t) and h.finish_reason == "length"
        seeded = engine.submit(Request(prompts[2], adapter="__base__", max_tokens=30, temperature=0.8, seed=3))
        assert seeded.result(60) and seeded.finish_reason in ("length", "stop")
        assert c.tokens == seeded.tokens[: len(c.tokens)]  # C's noise was its own
        quiet(engine)
        assert engine.metrics_snapshot()["failed_cycles"] == 3
    finally:
        for event in release.values():
            event.set()
        engine.stop()
    alone = Engine(model, max_batch=1, max_len=64, num_draft_tokens=2, gate="always").start()  # after: one lock
    try:
        assert seeded.tokens == alone.submit(Request(prompts[2], adapter="__base__", max_tokens=30, temperature=0.8,
                                                     seed=3)).result(60)
    finally:
        alone.stop()


def test_failures_are_in_the_metrics_endpoint(model):
    """/metrics exports the engine's failed steps and requests (serve.Metrics reads engine.metrics)."""
    pytest.importorskip("fastapi")
    from prometheus_client.parser import text_string_to_metric_families

    from hf_invisiblelora.serving.metrics import Metrics

    engine = Engine(model, max_batch=1, max_len=32)
    engine.metrics.update(failed_cycles=2, failed_requests=3)
    text = Metrics(engine, "tiny").render()[0].decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["hf_invisiblelora_failed_cycles_total"] == 2
    assert values["hf_invisiblelora_failed_requests_total"] == 3


def spy_passes(monkeypatch):
    """Record the decoder's prompt passes (rows, first slot, end slot, the rows decoding meanwhile, the
    prompt's slots, and "alone" for a pass of its own or "folded" for a chunk in a cycle's verify pass)
    and its cycles (the rows decoding)."""
    from hf_invisiblelora.decode.decoder import Decoder

    log, prefill, cycle = [], Decoder.prefill, Decoder.cycle

    def prefill_spy(self, idx, start, end):
        log.append(("prefill", tuple(idx), start, end, tuple(r for r in self.batch.active if r not in idx),
                    self.rows[idx[0]].plen, "alone"))
        return prefill(self, idx, start, end)

    def cycle_spy(self, joining=None):
        if joining is not None:
            rows, start, end = joining
            log.append(("prefill", tuple(rows), start, end, tuple(self.batch.active), self.rows[rows[0]].plen,
                        "folded"))
        log.append(("cycle", tuple(self.batch.active)))
        return cycle(self, joining)

    monkeypatch.setattr(Decoder, "prefill", prefill_spy)
    monkeypatch.setattr(Decoder, "cycle", cycle_spy)
    return log


def chunking_engine(model):
    """3 rows, prompts in chunks of 8 slots, prefix caching off (a prompt again is prefilled again)."""
    return Engine(model, max_batch=3, max_len=64, num_draft_tokens=2, gate="always", prefill_chunk=8,
                  prefix_caching=False).start()


def queued_together_as_standalone(engine, model, jobs):
    """``jobs`` ((prompt, adapter, max_tokens)) queued at once, greedy: each answer standalone generate()'s."""
    with engine._wake:
        handles = [engine.submit(Request(p, adapter=a, max_tokens=m, temperature=0)) for p, a, m in jobs]
    for (prompt, adapter, m), h in zip(jobs, handles):
        assert h.result(60) == standalone(model, prompt, adapter, m), adapter


@pytest.mark.parametrize("fold", [True, False])
def test_prompts_ride_in_the_cycles_verify_passes(model, monkeypatch, fold):
    """While rows decode, a joining prompt takes no pass of its own: it rides in a cycle's verify pass,
    in chunks of at most prefill_chunk tokens (8 here), one a cycle (fold=False: chunks too wide to
    fold, FOLD_SLOTS 0: passes of their own, one between two cycles); every greedy answer equals
    standalone generate(); a seeded sampled request gives the tokens it gives with whole-prompt
    prefills."""
    from hf_invisiblelora.engine import scheduler

    if not fold:
        monkeypatch.setattr(scheduler, "FOLD_SLOTS", 0)
    log = spy_passes(monkeypatch)
    g = torch.Generator().manual_seed(21)
    # The long prompt first: its row (0) waits for its chunks below a row that decodes (1).
    jobs = [(random_prompt(g, 37), "b", 6), (random_prompt(g, 3), "s", 56)] + \
        [(random_prompt(g, n), a, 6) for n, a in ((20, "__base__"), (29, "c"), (5, "d"))]
    # Prefix caching off: the same prompt again is the control of a whole prefill, not a cache hit.
    engine = chunking_engine(model)
    try:
        queued_together_as_standalone(engine, model, jobs)
        sampled = {}
        for chunk in (8, None):
            # The scheduler reads the limits it was given: the next prompt's chunks follow this one
            engine._scheduler.limits = dataclasses.replace(engine._scheduler.limits, prefill_chunk=chunk)
            h = engine.submit(Request(jobs[0][0], adapter="b", max_tokens=8, temperature=0.9, seed=5))
            sampled[chunk] = h.result(60)
            chunked_log = chunked_log if chunk is None else list(log)
    finally:
        engine.stop()
    assert sampled[8] == sampled[None]
    assert ("prefill", (0,), 0, 37, (), 37, "alone") in log[len(chunked_log):]  # the control: one pass
    log = chunked_log
    passes = [e for e in log if e[0] == "prefill"]
    assert all(len(e[1]) * (e[3] - e[2]) <= 8 for e in passes)  # the budget of every pass
    while_decoding = [e for e in passes if e[4]]
    assert len({(e[1], e[5]) for e in while_decoding}) >= 2  # groups (rows, prompt slots)
    assert {e[6] for e in while_decoding} == {"folded" if fold else "alone"}
    chunks = [0]  # chunks (not a whole prompt) per cycle while rows decode: at most one
    for x in log:
        if x[0] == "cycle":
            chunks.append(0)
        elif x[2:4] != (0, x[5]) and x[4]:
            chunks[-1] += 1
    assert max(chunks) == 1


@pytest.mark.parametrize("path", lora_layer.PATHS)
def test_ragged_passes_give_stock_tokens_on_every_torch_lora_path(model, monkeypatch, path):
    """Prompt chunks folded into cycles beside decoding rows (ragged passes: each row's real tokens,
    runs of several adapters and of none) on each torch LoRA path: standalone generate()'s tokens."""
    monkeypatch.setattr(lora_layer, "FORCE_PATH", path)
    g = torch.Generator().manual_seed(4)
    jobs = [(random_prompt(g, n), a, m) for n, a, m in ((3, "s", 14), (19, "b", 5), (11, "__base__", 6), (23, "c", 4),
                                                         (9, "d", 5))]
    engine = chunking_engine(model)
    try:
        queued_together_as_standalone(engine, model, jobs)
    finally:
        engine.stop()


def test_a_join_costs_no_pass_of_its_own(model, monkeypatch):
    """Short prompts joining rows that decode are prefilled in the cycles' verify passes: the model
    runs one pass per cycle (plus the drafts); only a group that joins while no row decodes (the
    first) has a pass of its own."""
    log = spy_passes(monkeypatch)
    g = torch.Generator().manual_seed(5)
    jobs = [(random_prompt(g, 3 + i % 5), NAMES[i % 4], 3 + 2 * (i % 4)) for i in range(10)]
    engine = Engine(model, max_batch=3, max_len=48, num_draft_tokens=2, gate="never").start()
    try:
        with engine._wake:
            handles = [engine.submit(Request(p, adapter=a, max_tokens=m, temperature=0)) for p, a, m in jobs]
        for (prompt, adapter, m), h in zip(jobs, handles):
            assert h.result(60) == standalone(model, prompt, adapter, m), adapter
    finally:
        engine.stop()
    passes = [e for e in log if e[0] == "prefill"]
    assert passes[0][4] == () and all((e[6] == "folded") == bool(e[4]) for e in passes)
    assert sum(e[6] == "folded" for e in passes) >= 3


def test_models_with_windowed_caches_prefill_whole_prompts(monkeypatch):
    """A cache layer keeping a window of keys (Gemma 3's sliding layers): prompts are prefilled in one
    pass whatever prefill_chunk says (a chunk could not see past the window as the one pass does);
    the answers equal standalone generate()."""
    log = spy_passes(monkeypatch)
    served = tiny_peft("gemma3", strength=0.6)
    g = torch.Generator().manual_seed(22)
    jobs = [(random_prompt(g, n), a, 5) for n, a in ((17, "s"), (12, "b"))]
    engine = Engine(served, max_batch=2, max_len=32, num_draft_tokens=2, gate="always", prefill_chunk=4).start()
    try:
        for prompt, adapter, m in jobs:
            assert engine.submit(Request(prompt, adapter=adapter, max_tokens=m, temperature=0)).result(60) == \
                standalone(served, prompt, adapter, m)
    finally:
        engine.stop()
    assert [e[2:4] for e in log if e[0] == "prefill"] == [(0, 17), (0, 12)]


def test_vllm_metrics_show_the_running_and_waiting_adapters(model):
    """/metrics carries vLLM's names for the queue and the adapters in use, as a router reads them:
    with the engine held inside a delivery (one row, "s" decoding; "b", the base model and "b" again
    waiting), the counts, the comma-separated adapter names (each once, the base model left out), and
    max_lora (one per row when max_loras is not set)."""
    pytest.importorskip("fastapi")
    from prometheus_client.parser import text_string_to_metric_families

    from hf_invisiblelora.serving.metrics import Metrics

    reached, release = threading.Event(), threading.Event()

    def pause(tokens):
        reached.set()
        assert release.wait(30)

    def scrape(metrics):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(metrics.render()[0].decode()) for s in f.samples}

    engine = Engine(model, max_batch=1, max_len=32, num_draft_tokens=2).start()
    metrics, tiny = Metrics(engine, "tiny"), (("engine", "0"), ("model_name", "tiny"))
    try:
        idle = scrape(metrics)
        assert idle[("vllm:num_requests_running", tiny)] == idle[("vllm:num_requests_waiting", tiny)] == 0
        assert ("vllm:lora_requests_info", (("max_lora", "1"), ("running_lora_adapters", ""),
                                            ("waiting_lora_adapters", ""))) in idle
        first = engine.submit(Request([3, 4, 5], adapter="s", max_tokens=4, temperature=0, on_tokens=pause))
        assert reached.wait(30)
        others = [engine.submit(Request([3, 4], adapter=a, max_tokens=2, temperature=0)) for a in ("b", "__base__", "b")]
        busy, now = scrape(metrics), time.time()
        assert busy[("vllm:num_requests_running", tiny)] == 1 and busy[("vllm:num_requests_waiting", tiny)] == 3
        assert busy[("vllm:kv_cache_usage_perc", tiny)] == 1.0
        stamp = busy[("vllm:lora_requests_info", (("max_lora", "1"), ("running_lora_adapters", "s"),
                                                  ("waiting_lora_adapters", "b")))]
        assert now - 5 < stamp <= now  # vLLM's value: the time of the scrape
    finally:
        release.set()
    try:
        assert first.result(30) == standalone(model, [3, 4, 5], "s", 4)
        for a, h in zip(("b", "__base__", "b"), others):
            assert h.result(30) == standalone(model, [3, 4], a, 2)
        with_bound = Metrics(Engine(model, max_batch=4, max_len=32, max_loras=2), "tiny")
        assert ("vllm:lora_requests_info", (("max_lora", "2"), ("running_lora_adapters", ""),
                                            ("waiting_lora_adapters", ""))) in scrape(with_bound)
    finally:
        engine.stop()


# --- bounded adapters: max_loras, max_cpu_loras, eviction and loading on demand ---


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: folder} of the module model's four adapters, saved (PEFT writes each to <dir>/<name>)."""
    folder = tmp_path_factory.mktemp("adapters")
    tiny_peft("llama", strength=0.6).save_pretrained(folder)
    return {name: str(folder / name) for name in ("s", "b", "c", "d")}


def evictions(monkeypatch, engine):
    """Record each adapter the engine deletes from the model, with the adapters of the batch's rows and
    of the waiting requests at that moment."""
    from hf_invisiblelora.engine import adapters

    seen, delete = [], adapters.remove_adapter

    def spy(model, name):
        seen.append((name, set(engine._rows.adapters()),
                     {h.request.adapter for h in engine._waiting}))
        return delete(model, name)

    monkeypatch.setattr(adapters, "remove_adapter", spy)
    return seen


def test_lru_eviction_and_loading_on_demand(model, saved, monkeypatch):
    """max_cpu_loras=2: a request for an evicted adapter loads it again (between cycles) and
    evicts the least recently used one; the reloaded adapters decode exactly as standalone generate()."""
    g = torch.Generator().manual_seed(11)
    served = tiny_peft("llama", adapters=("s",), strength=0.6)
    engine = Engine(served, max_batch=2, max_len=64, num_draft_tokens=2, gate="always", max_cpu_loras=2,
                    adapter_paths=saved).start()
    seen = evictions(monkeypatch, engine)
    try:
        assert engine.adapters() == ["s", "b", "c", "d"] and list(served.peft_config) == ["s"]
        for name, loaded in [("b", {"s", "b"}), ("s", {"s", "b"}), ("c", {"s", "c"}), ("d", {"c", "d"}),
                             ("b", {"d", "b"}), ("b", {"d", "b"})]:
            prompt = random_prompt(g, 4)
            assert engine.submit(Request(prompt, adapter=name, max_tokens=6, temperature=0)).result(60) == \
                standalone(model, prompt, name, 6), name
            quiet(engine)
            assert set(served.peft_config) == loaded, name
        assert [name for name, _, _ in seen] == ["b", "s", "c"]  # the least recently used (not the oldest load)
        m = engine.metrics_snapshot()
        assert (m["loads"], m["evictions"], m["loaded_adapters"]) == (4, 3, 2)
        assert engine.adapters() == ["s", "b", "c", "d"]
    finally:
        engine.stop()


def test_max_loras_bounds_every_pass(model, saved, monkeypatch):
    """No prefill or cycle has more than max_loras distinct adapters among its rows (the base model
    is none); every request decodes exactly, with adapters evicted and loaded again as they come."""
    from hf_invisiblelora.decode.decoder import Decoder

    passes = []
    admit, cycle = Decoder.admit, Decoder.cycle

    def distinct(names):
        return len({a for a in names if a not in (None, "__base__")})

    def admit_spy(self, idx, *args, **kw):
        out = admit(self, idx, *args, **kw)
        passes.append(distinct(self.names))
        return out

    def cycle_spy(self, *args, **kw):
        passes.append(distinct(self.names))
        return cycle(self, *args, **kw)

    monkeypatch.setattr(Decoder, "admit", admit_spy)
    monkeypatch.setattr(Decoder, "cycle", cycle_spy)
    g = torch.Generator().manual_seed(12)
    served = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    engine = Engine(served, max_batch=4, max_len=64, num_draft_tokens=2, gate="always", max_loras=2,
                    max_cpu_loras=3, adapter_paths=saved).start()
    try:
        jobs = [(random_prompt(g, 1 + i % 5), NAMES[i % 5], 2 + (3 * i) % 7) for i in range(15)]
        with engine._wake:  # queued together
            handles = [engine.submit(Request(p, adapter=a, max_tokens=m, temperature=0)) for p, a, m in jobs]
        for (prompt, name, m), h in zip(jobs, handles):
            assert h.result(120) == standalone(model, prompt, name, m) and h.finish_reason == "length"
        assert passes and max(passes) == 2
        assert engine.metrics_snapshot()["loads"] >= 2 and len(served.peft_config) <= 3
    finally:
        engine.stop()


def test_a_request_waiting_for_an_adapter_slot_is_not_overtaken(model, monkeypatch):
    """max_loras=1: a request for "b" behind a decoding "s" request waits for "s" to be done, and
    the "s" requests after it wait behind it (with no such rule they would join the batch while "s"
    decodes and could keep "b" out for ever); a base request, which needs no slot, passes it."""
    from hf_invisiblelora.decode.decoder import Decoder

    order = []
    admit = Decoder.admit

    def spy(self, idx, ids, mask, positions, max_new, names, **kw):
        order.extend(zip(names, max_new))
        return admit(self, idx, ids, mask, positions, max_new, names, **kw)

    monkeypatch.setattr(Decoder, "admit", spy)
    engine = Engine(model, max_batch=3, max_len=64, num_draft_tokens=2, gate="always", max_loras=1).start()
    try:
        jobs = [("s", 30), ("b", 5), ("s", 6), ("__base__", 7), ("s", 8), ("b", 9)]
        with engine._wake:
            handles = [engine.submit(Request([3, 4, 5], adapter=a, max_tokens=m, temperature=0)) for a, m in jobs]
        for h in handles:
            assert h.result(60) and h.finish_reason == "length"
        assert order.index(("__base__", 7)) < order.index(("b", 5)) < order.index(("s", 6)) < order.index(("b", 9))
    finally:
        engine.stop()


def test_an_adapter_in_use_is_never_evicted(model, saved, monkeypatch, tmp_path):
    """A load past max_cpu_loras evicts no adapter that a request decodes with or waits for: with
    none idle, the new adapter itself goes (still served, loaded when a request names it). A
    request for an evicted adapter that cannot be loaded ends with "error"; the engine serves on."""
    g = torch.Generator().manual_seed(13)
    served = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    paths = {name: saved[name] for name in ("s", "b")} | {"gone": str(tmp_path / "gone")}
    engine = Engine(served, max_batch=1, max_len=128, num_draft_tokens=2, gate="always", max_cpu_loras=2,
                    adapter_paths=paths).start()
    seen = evictions(monkeypatch, engine)
    try:
        long = engine.submit(Request(random_prompt(g, 3), adapter="s", max_tokens=100, temperature=0))
        while engine.running() < 1:
            time.sleep(0.01)
        waiting = engine.submit(Request(random_prompt(g, 3), adapter="b", max_tokens=4, temperature=0))
        engine.load_adapter("c", saved["c"])
        assert seen == [("c", {"s"}, {"b"})] and set(served.peft_config) == {"s", "b"} and "c" in engine.adapters()
        prompt = random_prompt(g, 5)
        later = engine.submit(Request(prompt, adapter="c", max_tokens=5, temperature=0))
        assert long.result(60) and waiting.result(60) and later.result(60) == standalone(model, prompt, "c", 5)
        assert all(victim not in running for victim, running, _ in seen)
        failed = engine.submit(Request([3, 4], adapter="gone", max_tokens=2, temperature=0))
        assert failed.result(60) == [] and failed.finish_reason == "error" and "gone" in failed.error
        assert engine.alive and len(served.peft_config) == 2
        assert engine.submit(Request(prompt, adapter="b", max_tokens=5, temperature=0)).result(60) == \
            standalone(model, prompt, "b", 5)
    finally:
        engine.stop()


def test_unloading_an_evicted_adapter(saved):
    """An evicted adapter is unloaded from the registry (the model does not change); the engine
    then refuses requests for it. The bounds are checked when the engine is made."""
    from hf_invisiblelora.engine import UnknownAdapter

    served = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    with pytest.raises(ValueError, match="more than max_cpu_loras=1"):
        Engine(served, max_cpu_loras=1, adapter_paths=saved)
    with pytest.raises(ValueError, match="no room"):
        Engine(served, max_cpu_loras=2)  # neither path known: nothing could ever be evicted
    with pytest.raises(ValueError, match="max_loras"):
        Engine(served, max_loras=0)
    engine = Engine(served, max_batch=1, max_len=32, max_cpu_loras=3, adapter_paths={"c": saved["c"]}).start()
    try:
        engine.unload_adapter("c")
        assert engine.adapters() == ["s", "b"] and list(served.peft_config) == ["s", "b"]
        with pytest.raises(UnknownAdapter):
            engine.submit(Request([3, 4], adapter="c"))
        with pytest.raises(UnknownAdapter):
            engine.unload_adapter("c")
        assert engine.metrics_snapshot()["loads"] == 0 and engine.alive
    finally:
        engine.stop()


def test_adapter_changes_free_the_old_banks(tmp_path):
    """Regression: every load or unload rebuilds the adapter bank, and each rebuilt bank's stacks
    stayed alive in reference cycles (a layer and its packs, a layer and its group) until the
    garbage collector's next full pass: on SmolLM2 the server grew by 100-300 MB per load/unload.
    With the collector off, nothing of an old bank may outlive the next rebuild, and the live
    tensors do not grow with the cycles."""
    import gc
    import weakref

    from hf_invisiblelora.model.state import state_of

    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    tiny_peft("llama", adapters=("d",), strength=0.6, seed=5).save_pretrained(tmp_path)
    engine = Engine(model, max_batch=2, max_len=64, num_draft_tokens=2, gate="always").start()

    def cycle():
        engine.load_adapter("new", str(tmp_path / "d"))
        assert engine.submit(Request([3, 4, 5], adapter="new", max_tokens=4, temperature=0)).result(60)
        engine.unload_adapter("new")
        # Served after the bank is rebuilt (a command returns before): no rebuild is under way.
        assert engine.submit(Request([3, 4, 5], adapter="s", max_tokens=2, temperature=0)).result(60)
        quiet(engine)

    def live_tensors():
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    try:
        cycle()
        gc.collect()
        gc.disable()
        try:
            old, counts = [], []
            for _ in range(4):
                bank = state_of(model).bank
                old += [weakref.ref(t) for layer in bank.layers.values() for t in (layer.A, layer.B)]
                old += [weakref.ref(group.A) for group in bank.groups]
                cycle()
                counts.append(live_tensors())
        finally:
            gc.enable()
        assert sum(ref() is not None for ref in old) == 0
        assert counts[-1] <= counts[0]
    finally:
        engine.stop()


def test_request_options_decode_as_generate_with_them(model):
    """repetition_penalty, min_tokens, stop_token_ids and ignore_eos, mixed in one batch with drafts,
    each equal to standalone generate() with Transformers' matching options (the model's EOS is a
    token its greedy output reaches)."""
    g = torch.Generator().manual_seed(5)
    prompt = random_prompt(g, 4)
    free = standalone(model, prompt, "b", 16)
    at = next(i for i in range(3, 16) if free[i] not in free[:i])
    eos_model = tiny_peft("llama", strength=0.6)
    eos_model.generation_config.eos_token_id = eos = free[at]
    stop = free[1]
    cases = [  # engine request options -> generate() options
        (dict(), dict()),
        (dict(ignore_eos=True), dict(eos_token_id=[])),
        (dict(stop_token_ids=[stop]), dict(eos_token_id=[eos, stop])),
        (dict(min_tokens=at + 2), dict(min_new_tokens=at + 2)),
        (dict(min_tokens=3, stop_token_ids=[stop], repetition_penalty=0.7), dict(min_new_tokens=3, eos_token_id=[eos, stop],
                                                                                 repetition_penalty=0.7)),
        (dict(repetition_penalty=1.6, ignore_eos=True), dict(repetition_penalty=1.6, eos_token_id=[])),
        (dict(repetition_penalty=1.6, adapter="__base__"), dict(repetition_penalty=1.6, adapter="__base__")),
    ]
    expected = []
    for opts, kw in cases:
        kw = dict(kw)
        adapter = kw.pop("adapter", "b")
        stops = kw.pop("eos_token_id", [eos])
        out = eos_model.generate(input_ids=torch.tensor([prompt]), adapter_names=[adapter], max_new_tokens=16,
                                 do_sample=False, eos_token_id=stops or None, pad_token_id=0, **kw)[0, 4:].tolist()
        cut = next((i for i, t in enumerate(out) if t in stops), None)
        expected.append((out, "length") if cut is None else (out[: cut + 1], "stop"))
    assert len({tuple(e) for e, _ in expected}) >= 5  # the options change the output
    engine = Engine(eos_model, max_batch=4, max_len=64, num_draft_tokens=3, gate="always").start()
    try:
        handles = [engine.submit(Request(prompt, **{"adapter": "b", **opts}, max_tokens=16, temperature=0))
                   for opts, _ in cases]
        for (opts, _), (want, reason), h in zip(cases, expected, handles):
            assert h.result(60) == want and h.finish_reason == reason, opts
    finally:
        engine.stop()


def test_logprobs_are_the_targets_raw_ones(model):
    """Each committed token's log-probability and the top ones: log-softmax of the LoRA-on logits at
    its position (what a plain forward of the prompt and output gives), greedy and sampled, drafts or not."""
    g = torch.Generator().manual_seed(8)
    engine = Engine(model, max_batch=3, max_len=64, num_draft_tokens=3, gate="always").start()
    try:
        reqs = [Request(random_prompt(g, 3 + i), adapter=NAMES[i], max_tokens=9, temperature=(0, 0.8, 1.0)[i], seed=i,
                        logprobs=(4, 0, 2)[i]) for i in range(3)]
        handles = [engine.submit(r) for r in reqs]
        for r, h in zip(reqs, handles):
            out = h.result(60)
            assert len(h.logprobs) == len(out)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([r.prompt + out]), adapter_names=[r.adapter]).logits[0]
            ref = logits[len(r.prompt) - 1 : -1].float().log_softmax(-1)
            for j, (lp, top) in enumerate(h.logprobs):
                assert abs(lp - float(ref[j, out[j]])) < 1e-5
                best = ref[j].topk(r.logprobs)
                assert [i for i, _ in top] == best.indices.tolist()
                assert all(abs(v - w) < 1e-5 for (_, v), w in zip(top, best.values.tolist()))
    finally:
        engine.stop()
