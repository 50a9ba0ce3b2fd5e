"""Property-based: random request mixes on the serving engine (prompt lengths and budgets up to the
engine's limit, submitted together or while others decode, cancelled, adapters and "__base__",
K 0..4, gate modes, greedy and seeded sampling, an injected failure now and then) decode as standalone
generate() (greedy, float64) or as the same request alone in a fresh engine (seeded sampling); after
each mix the engine is alive and idle, its rows are free and its metrics add up.
ENGINE_PROPERTY_EXAMPLES sets the number of examples (more for a longer search)."""

import collections
import contextlib
import itertools
import os
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.decode import decoder as decoding
from hf_invisiblelora.decode.batch import Phase
from hf_invisiblelora.engine import Engine, Request, scheduler
from hf_invisiblelora.engine.scheduler import prefill_groups
from hf_invisiblelora.model import layout
from tiny import EOS, tiny_peft

EXAMPLES = int(os.environ.get("ENGINE_PROPERTY_EXAMPLES", 50))
VOCAB = 64
NAMES = ["s", "b", "c", "d", "__base__"]
MODEL = []
GREEDY, ALONE = {}, {}  # reference outputs


def model():
    if not MODEL:
        MODEL.append(tiny_peft("llama", vocab=VOCAB, strength=0.6))
    return MODEL[0]


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def standalone(prompt, adapter, max_tokens):
    key = (tuple(prompt), adapter, max_tokens)
    if key not in GREEDY:
        out = model().generate(input_ids=torch.tensor([prompt]), adapter_names=[adapter], max_new_tokens=max_tokens,
                               do_sample=False)
        GREEDY[key] = out[0, len(prompt):].tolist()
    return GREEDY[key]


def alone(spec, engine_kw):
    """The request alone in a fresh engine with the same settings (after the one under test stopped:
    engines on one model take turns)."""
    key = (tuple(spec.prompt), spec.adapter, spec.max_tokens, tuple(sorted(spec.sampling.items())),
           tuple(sorted(engine_kw.items())))
    if key not in ALONE:
        engine = Engine(model(), **engine_kw).start()
        try:
            ALONE[key] = engine.submit(Request(spec.prompt, adapter=spec.adapter, max_tokens=spec.max_tokens,
                                               **spec.sampling)).result(120)
        finally:
            engine.stop()
    return ALONE[key]


@st.composite
def mixes(draw):
    k = draw(st.integers(0, 4))
    engine_kw = dict(max_batch=draw(st.integers(1, 4)), max_len=draw(st.integers(k + 3, 36)), num_draft_tokens=k,
                     gate=draw(st.sampled_from(["always", "never", "auto"])),
                     prefill_chunk=draw(st.sampled_from([None, 2, 5, 512])))  # prompts in chunks of rows x tokens
    limit = engine_kw["max_len"] - k - 1  # the engine's max_request_tokens (the tiny model allows 2048 positions)
    specs = []
    for i in range(draw(st.integers(1, 6))):
        shape = draw(st.sampled_from(["any", "long prompt", "long budget"]))
        if shape == "long prompt":  # with a long budget beside it: the rows of a joint prefill must fit
            n = draw(st.integers(max(1, limit - 3), limit - 1))
            m = draw(st.integers(1, limit - n))
        elif shape == "long budget":
            m = draw(st.integers(max(1, limit - 3), limit - 1))
            n = draw(st.integers(1, limit - m))
        else:
            n = draw(st.integers(1, limit - 1))
            m = draw(st.integers(1, limit - n))
        sampling = dict(temperature=0.0)
        if draw(st.booleans()):
            sampling = dict(temperature=draw(st.sampled_from([0.7, 1.0, 1.5])), top_k=draw(st.sampled_from([0, 5])),
                            top_p=draw(st.sampled_from([1.0, 0.9])), seed=draw(st.integers(0, 2**40)))
        specs.append(SimpleNamespace(
            prompt=prompt_of(draw(st.integers(0, 10**6)), n), adapter=draw(st.sampled_from(NAMES)), max_tokens=m,
            sampling=sampling,
            # None, "queued": cancelled before it can be admitted, j: cancelled by its callback at its chunk j
            cancel=draw(st.sampled_from([None, None, None, "queued", 0, 1])),
            later=i > 0 and draw(st.booleans()),  # submitted once the request before it has tokens
        ))
    # An injected exception: in the j-th prefill (its rows' load, or one of its passes: a chunk) or the
    # j-th decoder cycle (then only those in it fail).
    fault = draw(st.sampled_from([None, "prefill", "chunk", "cycle"]))
    return engine_kw, specs, (fault, draw(st.integers(0, 3))) if fault else None


@contextlib.contextmanager
def injected(fault):
    """Raise once, at the j-th call of the prefill's layout load, of a prefill pass or of a cycle's verify pass."""
    if fault is None:
        yield
        return
    stage, j = fault
    calls = itertools.count()
    target, name = {"prefill": (layout.RowLayout, "load"), "chunk": (decoding.Decoder, "prefill"),
                    "cycle": (decoding, "verify")}[stage]
    original = getattr(target, name)

    def failing(*args, **kw):
        if next(calls) == j:
            raise RuntimeError(f"injected {stage} failure")
        return original(*args, **kw)

    with mock.patch.object(target, name, failing):
        yield


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(mix=mixes())
def test_request_mixes_decode_exactly(mix):
    engine_kw, specs, fault = mix
    engine = Engine(model(), **engine_kw).start()
    handles, splits, checked = [], [], []
    groups = scheduler.prefill_groups
    try:
        with injected(fault), mock.patch.object(scheduler, "prefill_groups",
                                                lambda *a: splits.append(len(out := groups(*a))) or out):
            waves = []
            for spec in specs:
                if spec.later or not waves:
                    waves.append([])
                waves[-1].append(spec)
            for wave in waves:
                if handles:
                    last = handles[-1]
                    wait_for(lambda: last.tokens or last.done.is_set())
                with engine._wake:  # a wave is queued at once: it joins in one admission, as far as rows allow
                    for spec in wave:
                        box = []

                        def on_tokens(tokens, box=box, spec=spec, chunks=itertools.count()):
                            if next(chunks) == spec.cancel:
                                box[0].cancel()
                            return False

                        h = engine.submit(Request(spec.prompt, adapter=spec.adapter, max_tokens=spec.max_tokens,
                                                  on_tokens=on_tokens, **spec.sampling))
                        box.append(h)
                        handles.append(h)
                        if spec.cancel == "queued":
                            h.cancel()
            for h in handles:
                h.result(120)
            # Idle: every row free, nothing of a request left in the engine.
            assert engine.alive and engine.running() == 0 and engine.queue_length() == 0
            wait_for(lambda: engine._decoder is not None)  # built on the engine's thread as it starts
            decoder = engine._decoder
            assert all(row.phase is Phase.FREE for row in decoder.rows)
            assert decoder.names == [None] * engine.limits.max_batch
            assert decoder.policy.rows == [None] * engine.limits.max_batch
            m = engine.metrics_snapshot()
            if fault is not None:  # the engine serves on: a new request decodes exactly
                again = SimpleNamespace(**{**vars(specs[0]), "cancel": None})
                h = engine.submit(Request(again.prompt, adapter=again.adapter, max_tokens=again.max_tokens,
                                          **again.sampling))
                h.result(120)
                checked = [(again, h)]
    finally:
        engine.stop()

    failed = [h for h in handles if h.finish_reason == "error"]
    event(f"fault: {fault[0] if fault else None}, {'fired' if failed else 'not fired'}")
    event(f"most prefill groups in one admission: {max(splits, default=0)}")
    event(f"prefill_chunk: {engine_kw['prefill_chunk']}")
    event(f"finish reasons: {sorted({h.finish_reason for h in handles})}")
    event(f"seeded sampling: {any(spec.sampling['temperature'] for spec in specs)}")
    event(f"arrivals: {'some while others decode' if any(spec.later for spec in specs) else 'all at once'}")
    assert m["failed_requests"] == len(failed) and m["failed_cycles"] == (1 if failed else 0)
    assert fault is not None or not failed
    for spec, h in list(zip(specs, handles)) + checked:
        expected = standalone(spec.prompt, spec.adapter, spec.max_tokens) if spec.sampling["temperature"] == 0 \
            else alone(spec, engine_kw)
        reason = "stop" if expected[-1] == EOS else "length"
        assert h.tokens == expected[: len(h.tokens)], (spec, h.finish_reason)
        if h.finish_reason == "cancelled":
            assert spec.cancel is not None and len(h.tokens) < len(expected)
        elif h.finish_reason == "error":
            assert ("decoding" if fault[0] == "cycle" else "prefill") in h.error
            assert len(h.tokens) < len(expected)
        else:
            assert h.finish_reason == reason and h.tokens == expected, (spec, h.finish_reason)
        if spec.cancel == "queued":
            assert h.tokens == [] and h.finish_reason == "cancelled"

    # The metrics add up (the request submitted after a fault is not in the snapshot).
    # (A request that failed was in a row: in its prefill, or in a cycle its prompt rode in or it decoded in.)
    admitted = [h for h in handles if h.tokens or h.finish_reason == "error"]
    assert m["requests"] == len(admitted)
    assert m["tokens"] == sum(len(h.tokens) for h in handles)
    assert sum(m["k_hist"].values()) == m["cycles"]
    assert all(0 <= k <= engine_kw["num_draft_tokens"] for k in m["k_hist"])
    if engine_kw["gate"] == "never" or engine_kw["num_draft_tokens"] == 0:
        assert set(m["k_hist"]) <= {0}
    for key in ("drafted", "accepted"):
        per_adapter = collections.Counter()
        for h in handles:
            per_adapter[h.request.adapter] += getattr(h, key)
        assert +collections.Counter(m[key]) == +per_adapter, key
    assert all(0 <= h.accepted <= h.drafted for h in handles)


def fewest_groups(items, room):
    """The fewest prefill groups by brute force: every partition of ``items`` into groups whose rows fit."""
    def partitions(xs):
        if not xs:
            yield []
            return
        first, rest = xs[0], xs[1:]
        for p in partitions(rest):
            for i in range(len(p)):
                yield p[:i] + [[first] + p[i]] + p[i + 1:]
            yield [[first]] + p

    def fits(group):
        return max(n for n, _ in group) + max(m for _, m in group) <= room

    return min(len(p) for p in partitions(items) if all(fits(g) for g in p))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(room=st.integers(2, 20), data=st.data())
def test_prefill_groups_fit_and_are_fewest(room, data):
    """scheduler.prefill_groups: a partition of the joining requests, each group in FIFO order and in the
    order of its first request, every row fitting beside the group's longest prompt, and as few
    groups as any partition whose rows fit."""
    request = st.integers(1, room - 1).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, room - n)))
    items = data.draw(st.lists(request, min_size=1, max_size=6))  # (prompt length, max_tokens), each valid
    joining = [(r, SimpleNamespace(request=SimpleNamespace(prompt=[2] * n, max_tokens=m)))
               for r, (n, m) in enumerate(items)]
    groups = prefill_groups(joining, room)
    flat = [rh for g in groups for rh in g]
    assert sorted(r for r, _ in flat) == list(range(len(items)))
    assert all([r for r, _ in g] == sorted(r for r, _ in g) for g in groups)
    assert [g[0][0] for g in groups] == sorted(g[0][0] for g in groups)
    for g in groups:
        width = max(len(h.request.prompt) for _, h in g)
        assert all(width + h.request.max_tokens <= room for _, h in g)
    assert len(groups) == fewest_groups(items, room)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
