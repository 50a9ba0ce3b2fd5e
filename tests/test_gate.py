"""The gate on synthetic costs and acceptance."""

import time

import pytest
import torch

from hf_invisiblelora.decode.decoder import PassTimer
from hf_invisiblelora.decode.gate import (
    COST_BOUND_PROBE,
    COST_WINDOW,
    MARGIN,
    PRIOR_ACCEPTANCE,
    PROBE_AFTER,
    Gate,
    GateMemory,
    cycles,
    expected_max,
    expected_tokens,
)

K = 4
ROWS = ["x", "y", "x", "__base__"]


def gate_with(costs_by_q, draft_cost, acceptance, rows=ROWS, mode="auto"):
    mem = GateMemory()
    shape = (len(rows), len(set(rows)), "eager", torch.get_num_threads())
    for q, t in costs_by_q.items():
        mem.costs[("verify", shape, q)] = t
    if draft_cost is not None:
        mem.costs[("draft", (len(rows), "eager", torch.get_num_threads()))] = draft_cost
    for name, a in acceptance.items():  # strong evidence, far above the prior's weight
        mem.accepted[name], mem.trials[name] = 1000 * a, 1000.0
    gate = Gate(mode, K, mem, "__base__")
    gate.set_rows(rows)
    return gate


def brute_force_best(costs_by_q, draft_cost, acc, remaining=50):
    """With every row ``remaining`` tokens from its end, the row that accepts least finishes last:
    its cycles' mean plus the spread of the slowest of the drafting rows (Monte Carlo below checks it)."""
    a, n = min(acc), sum(1 for x in acc if x < 1)
    z = expected_max(n)
    rate = []
    for k in range(K + 1):
        p = [a**(j - 1) * (1 - a) for j in range(1, k + 1)] + [a**k]  # tokens committed: j = 1..k+1
        mu = sum(j * q for j, q in enumerate(p, 1))
        var = sum(j * j * q for j, q in enumerate(p, 1)) - mu * mu
        n_cycles = remaining / mu + z * (remaining * var / mu**3) ** 0.5
        rate.append(1 / (n_cycles * (k * draft_cost + costs_by_q[k + 1])))
    rate[0] *= MARGIN  # drafting must promise a margin over a plain step
    return max(range(K + 1), key=rate.__getitem__)


def test_expected_tokens():
    assert expected_tokens(1.0, 50, 3) == 4 and expected_tokens(0.0, 50, 3) == 1
    assert expected_tokens(0.5, 50, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 2, 3) == 2 and expected_tokens(0.5, 1, 3) == 1  # at most what the row has left


def test_cycles_of_the_slowest_row_match_a_simulation():
    """The gate's estimate of the cycles the last of n rows needs (mean plus z(n) standard
    deviations) against simulated rows committing 1..k+1 tokens a cycle with geometric acceptance
    (many tokens left: the last cycle's overshoot, which the estimate leaves out, is small)."""
    gen = torch.Generator().manual_seed(0)
    for a, k, n, r in ((0.86, 1, 8, 48), (0.7, 3, 4, 64), (0.95, 4, 16, 160), (0.5, 2, 1, 80)):
        trials = 2000
        left = torch.full((trials, n), r)
        count = torch.zeros(trials, n)
        while (left > 0).any():
            going = left > 0
            accepted = (torch.rand(trials, n, k, generator=gen) < a).long().cumprod(-1).sum(-1)
            left = torch.where(going, left - (accepted + 1), left)
            count += going
        simulated = count.max(1).values.mean().item()
        assert cycles(a, r, k, expected_max(n)) == pytest.approx(simulated, rel=0.04), (a, k, n, r)
    assert cycles(0.9, 50, 0, 2.0) == 50 and cycles(1.0, 50, 3, 2.0) == 12.5
    assert expected_max(1) == 0 and expected_max(8) == pytest.approx(1.42, abs=0.02)


def test_the_spread_of_many_rows_can_make_drafting_lose():
    """8 rows accepting 86%: k = 1 promises 3% on the mean rows, but the call waits for its last
    row, ~5% behind the mean: the gate of a generate call does not draft; an engine's (rows end on
    their own) does."""
    rows = [f"a{i % 4}" for i in range(8)]
    costs = {1: 0.086, 2: 0.108, 3: 0.13}
    acc = {name: 0.86 for name in rows}
    assert gate_with(costs, 0.045, acc, rows=rows).choose([48] * 8) == 0
    g = gate_with(costs, 0.045, acc, rows=rows)
    g.together = False
    assert g.choose([48] * 8) == 1


def test_an_engine_weighs_its_rows_tokens_a_call_its_last_row():
    """Prompt lookup with a 3-token match for half the rows and none for the others: a generate call
    waits for its last row, which cannot gain this cycle, and takes a plain step; a serving engine's
    requests end on their own, and it drafts for the rows that can use it (the others commit their
    one token as in a plain step)."""
    rows = [f"a{i % 4}" for i in range(8)]
    costs = {1: 0.1, 2: 0.112, 3: 0.124, 4: 0.136, 5: 0.148}
    mem = GateMemory()
    shape = (8, 4, "eager", torch.get_num_threads())
    for q, t in costs.items():
        mem.costs[("verify", shape, q)] = t
    mem.costs[("draft", (8, "eager/lookup", torch.get_num_threads()))] = 0.0005
    for a in set(rows):
        mem.accepted[(a, "/lookup/3")], mem.trials[(a, "/lookup/3")] = 870.0, 1000.0
    labels = [["3", None] * 4]
    for together, drafts in ((True, False), (False, True)):
        g = Gate("auto", K, mem, "__base__", drafters=("/lookup",), together=together)
        g.set_rows(rows)
        assert (g.choose([48] * 8, labels) > 0) == drafts


def test_no_drafting_when_it_cannot_pay():
    # CPU-like: a pass costs in proportion to its tokens, and a draft pass as much as a plain step.
    costs = {q: 0.1 * q for q in range(1, K + 2)}
    g = gate_with(costs, 0.1, {"x": 0.95, "y": 0.95})
    assert g.choose([50] * 4) == 0


def test_best_k_when_drafting_pays():
    # GPU-like: wide verify nearly free, adapters expensive (plain step 2x a draft step).
    costs = {q: 0.2 + 0.01 * q for q in range(1, K + 2)}
    for a, expect_high in ((0.95, True), (0.5, False)):
        g = gate_with(costs, 0.1, {"x": a, "y": a})
        acc = [g.memory.acceptance(n) if n != "__base__" else 1.0 for n in ROWS]
        k = g.choose([50] * 4)
        assert k == brute_force_best(costs, 0.1, acc)
        assert (k >= K - 1) == expect_high  # (the spread of 3 drafting rows and the overshoot at the end: K - 1 here)


def test_interpolates_unmeasured_verify_costs():
    costs = {1: 0.21, K + 1: 0.25}  # only the calibration points are known
    full = {q: 0.21 + 0.01 * (q - 1) for q in range(1, K + 2)}
    g = gate_with(costs, 0.1, {"x": 0.7, "y": 0.7})
    acc = [0.7, 0.7, 0.7, 1.0]
    assert g._costs()[0] == pytest.approx([k * 0.1 + full[k + 1] for k in range(K + 1)])
    assert g.choose([50] * 4) == brute_force_best(full, 0.1, acc)


def test_the_row_that_finishes_last_sets_k():
    # GPU-like costs. Three rows accept 99% of drafts, one 30%: drafting K would commit the most
    # tokens per cycle, but the call lasts until the 30% row is done, and for it drafts do not pay.
    costs = {q: 0.2 + 0.01 * q for q in range(1, K + 2)}
    g = gate_with(costs, 0.1, {"x": 0.99, "y": 0.3}, rows=["x", "x", "x", "y"])
    assert g.choose([50] * 4) == 0
    assert g.choose([50, 50, 50, 0]) == K  # once it is done, the rest draft
    assert g.choose([50, 50, 50, 2]) == K  # or nearly: 2 plain steps finish it before the others


def test_adapts_when_acceptance_changes():
    costs = {q: 0.2 + 0.01 * q for q in range(1, K + 2)}
    g = gate_with(costs, 0.1, {"x": 0.99, "y": 0.99})
    assert g.choose([50] * 4) == K
    for _ in range(400):  # the adapters start disagreeing with the base model
        g.observe(K, [0, 0, 0, K], [True] * 4, draft_s=0.4, verify_s=0.25)
    assert g.memory.acceptance("x") < 0.1 and g.memory.acceptance("y") < 0.1
    assert g.choose([50, 50, 50, 0]) == 0


def test_calibrates_then_explores_with_backoff():
    g = gate_with({}, None, {})
    assert g.choose([50] * 4) == 0  # first: measure a plain step
    g.observe(0, [0] * 4, [True] * 4, None, verify_s=0.1)
    assert g.choose([50] * 4) == 1  # then: the cheapest drafting cycle
    g.observe(1, [0, 0, 0, 1], [True] * 4, draft_s=0.04, verify_s=0.12)
    # Measured: drafting would pay only at high acceptance, and x and y rejected their drafts. Plain
    # steps, a k = 1 re-check after PROBE_AFTER, the next 2x later, and the backoff carries over to
    # the next generate call (a new Gate on the same memory).
    picks = [g.choose([50] * 4) for _ in range(2 * PROBE_AFTER)]
    later = Gate("auto", K, g.memory, "__base__")
    later.set_rows(ROWS)
    picks += [later.choose([50] * 4) for _ in range(2 * PROBE_AFTER)]
    assert [(i, k) for i, k in enumerate(picks) if k] == [(PROBE_AFTER - 1, 1), (3 * PROBE_AFTER - 1, 1)]


def test_costs_alone_ruling_drafting_out_are_rechecked_rarely():
    """A draft pass that costs a plain step, and a 2-token verify 2 plain steps: drafting loses even if
    every draft is accepted, so a re-check cannot change the decision through acceptance. It comes
    only every COST_BOUND_PROBE cycles (refreshing the draft's cost), not every PROBE_AFTER."""
    costs = {q: 0.1 * q for q in range(1, K + 2)}
    g = gate_with(costs, 0.1, {"x": 0.9, "y": 0.9})
    picks = [g.choose([50] * 4) for _ in range(3 * COST_BOUND_PROBE)]
    assert [i for i, k in enumerate(picks) if k] == [COST_BOUND_PROBE - 1, 3 * COST_BOUND_PROBE - 1]
    # Where every accepted draft would pay (draft passes cheap), acceptance decides: re-checked soon.
    g = gate_with({1: 0.1, 2: 0.12, 3: 0.14, 4: 0.16, 5: 0.18}, 0.02, {"x": 0.05, "y": 0.05})
    picks = [g.choose([50] * 4) for _ in range(PROBE_AFTER)]
    assert [i for i, k in enumerate(picks) if k] == [PROBE_AFTER - 1]


def test_what_one_adapter_count_measured_serves_another():
    """The draft pass (LoRA off) costs the same whatever the adapters: measured with 2 adapters, it
    is known with 3. And a first plain step with 3 adapters is enough to decide: the verify widths
    are scaled from the 2-adapter curve at the same rows, so no calibration cycle is spent."""
    rows2, rows3 = ["x", "y", "x", "y"], ["x", "y", "z", "x"]
    mem = GateMemory()
    for q, t in {1: 0.2, 2: 0.3, 3: 0.4}.items():
        mem.costs[("verify", (4, 2, "eager", torch.get_num_threads()), q)] = t
    mem.costs[("draft", (4, "eager", torch.get_num_threads()))] = 0.2
    g = Gate("auto", K, mem, "__base__")
    g.set_rows(rows3)
    assert g.choose([50] * 4) == 0  # a plain step: this shape's first measurement
    g.observe(0, [0] * 4, [True] * 4, None, verify_s=0.4)
    assert g._costs()[0] == pytest.approx([0.4, 0.2 + 0.6, 0.4 + 0.8, 0.6 + 1.0])  # the 2-adapter curve, x2
    assert g.choose([50] * 4) == 0  # decided from it: drafting cannot pay here, no calibration cycle
    other = Gate("auto", K, mem, "__base__", drafters=("/int4",))  # another drafter's costs are its own
    other.set_rows(rows2)
    assert other._costs()[0] is None


def test_rechecks_a_plain_step_while_drafting():
    # Drafting pays (GPU-like); a plain step now and then keeps its cost, the reference, fresh.
    costs = {q: 0.2 + 0.01 * q for q in range(1, K + 2)}
    g = gate_with(costs, 0.1, {"x": 0.99, "y": 0.99})
    picks = [g.choose([50] * 4) for _ in range(4 * PROBE_AFTER)]
    assert [i for i, k in enumerate(picks) if k != K] == [PROBE_AFTER - 1, 3 * PROBE_AFTER - 1]
    assert picks[PROBE_AFTER - 1] == 0


def test_grows_k_one_step_past_the_widest_timed_verify():
    # Only a plain step and k = 1 were timed; wide verifies look nearly free by extrapolation, but k
    # may reach only 2 (verify width 3) until that width is timed too.
    g = gate_with({1: 0.2, 2: 0.21}, 0.05, {"x": 0.95, "y": 0.95})
    assert g._costs()[0] == pytest.approx([0.2, 0.05 + 0.21, 0.1 + 0.22])
    assert g.choose([50] * 4) == 2
    g.observe(2, [2, 2, 2, 2], [True] * 4, draft_s=0.1, verify_s=0.22)
    assert g.choose([50] * 4) == 3


def test_extrapolated_verify_never_cheaper_than_the_widest_timed():
    g = gate_with({1: 0.2, 2: 0.19}, 0.05, {"x": 0.95, "y": 0.95})  # noise: width 2 timed below width 1
    assert g._costs()[0][2] == pytest.approx(0.1 + 0.19)


def test_cost_is_the_fastest_of_recent_timings():
    mem = GateMemory()
    for t in [5.0, 0.1] + [0.1] * (COST_WINDOW - 3) + [5.0]:  # slow passes (the OS, a cold start) change nothing
        mem.observe_cost("x", t)
    assert mem.costs["x"] == pytest.approx(0.1)
    mem.observe_cost("x", 0.08)  # a faster pass is the work's cost at once
    assert mem.costs["x"] == pytest.approx(0.08)
    for _ in range(COST_WINDOW):  # a lasting slowdown is followed within a window
        mem.observe_cost("x", 0.3)
    assert mem.costs["x"] == pytest.approx(0.3)


def test_a_cold_first_plain_step_does_not_make_drafting_look_cheap():
    """The calibration's plain step is the first cycle after a prefill (cold caches): timed alone it
    was the reference every drafting choice was weighed against. One warm plain step corrects it."""
    mem = GateMemory()
    g = Gate("auto", K, mem, "__base__")
    g.set_rows(["x", "y"])
    mem.accepted.update(x=70.0, y=70.0)
    mem.trials.update(x=100.0, y=100.0)
    g.observe(0, [0, 0], [True, True], None, 0.30)  # cold: twice the warm step
    for _ in range(3):
        g.observe(1, [1, 1], [True, True], 0.04, 0.22)  # warm k = 1 cycles
    assert g.choose([50, 50]) >= 1  # against the cold step, drafting looks 1.4x
    g.observe(0, [0, 0], [True, True], None, 0.15)  # one warm plain step
    assert all(g.choose([50, 50]) == 0 for _ in range(PROBE_AFTER - 1))  # (0.04 + 0.22) / 1.7 > 0.15 / 1.02


def test_obvious_cases():
    costs = {q: 0.2 + 0.01 * q for q in range(1, K + 2)}
    assert gate_with(costs, 0.1, {}, rows=["__base__"] * 3).choose([50] * 3) == 0
    g = gate_with(costs, 0.1, {"x": 0.99, "y": 0.99})
    assert g.choose([0, 0, 0, 50]) == 0  # only a __base__ row is still decoding
    assert g.choose([2] * 4) == 1  # never more drafts than can be used
    assert gate_with({}, None, {}, mode="always").choose([50] * 4) == K
    assert gate_with(costs, 0.1, {"x": 1.0, "y": 1.0}, mode="never").choose([50] * 4) == 0


def test_pass_timer_on_cpu():
    timer = PassTimer(torch.device("cpu"))
    with timer("verify"):
        time.sleep(0.02)
    spans = timer.collect()
    assert 0.015 < spans["verify"] < 1.0 and timer.collect() == {}


def test_marginal_gains_do_not_trigger_drafting():
    # k = 1 promises 1% more speed than a plain step: within the noise margin, so no drafting;
    # 4% more is beyond it.
    a, plain = 0.9, 0.2
    for gain, k in ((1.01, 0), (1.04, 1)):
        t1 = (1 + a) * plain / gain  # time of a k = 1 cycle that gives `gain` times the plain rate
        costs = {1: plain, 2: t1 - 0.1, 3: 10.0, 4: 10.0, 5: 10.0}
        g = gate_with(costs, 0.1, {"x": a, "y": a}, rows=["x", "y"])
        assert g.choose([50, 50]) == k
    assert 1.01 < MARGIN < 1.04


def test_acceptance_is_learned_per_drafter():
    """A cheaper drafter is accepted less often: what one drafter taught the gate does not steer
    another's decisions, and each learns from its own cycles."""
    mem = GateMemory()
    full, vocab = Gate("auto", K, mem, "__base__"), Gate("auto", K, mem, "__base__", drafters=("/vocab64",))
    for g in (full, vocab):
        g.set_rows(["x", "x"])
    for _ in range(50):
        full.observe(2, [2, 2], [True, True], 0.01, 0.02)  # every draft kept
        vocab.observe(2, [0, 0], [True, True], 0.01, 0.02)  # none kept
    assert mem.acceptance("x") > 0.9 and mem.acceptance(("x", "/vocab64")) < 0.1


def test_a_new_adapter_starts_from_its_drafters_acceptance():
    """The prior of an adapter the gate has not seen draft is its drafter's acceptance over the adapters
    it has seen: a drafter rarely accepted (prompt lookup on prose) starts low for a new adapter, a
    drafter accepted often starts high; the adapter's own evidence then takes over."""
    mem = GateMemory()
    lookup, full = Gate("auto", K, mem, "__base__", drafters=("/lookup",)), Gate("auto", K, mem, "__base__")
    for g in (lookup, full):
        g.set_rows(["x", "y"])
    for _ in range(50):
        lookup.observe(2, [0, 0], [True, True], 0.001, 0.02)  # rejected
        full.observe(2, [2, 2], [True, True], 0.01, 0.02)  # kept
    assert mem.acceptance(("new", "/lookup")) < 0.15 and mem.acceptance("new") > 0.9
    assert abs(GateMemory().acceptance(("new", "/lookup")) - PRIOR_ACCEPTANCE) < 1e-12  # nothing seen: the fixed prior
    g = Gate("auto", K, mem, "__base__", drafters=("/lookup",))
    g.set_rows(["new", "new"])
    for _ in range(50):
        g.observe(2, [2, 2], [True, True], 0.001, 0.02)  # this adapter's lookups are kept
    assert mem.acceptance(("new", "/lookup")) > 0.8


def test_picks_among_drafters_by_cost_and_acceptance():
    """Two drafters: the full one (draft pass 0.1 s) and a cheap one (0.03 s). Each is calibrated with one
    k = 1 cycle; then the gate drafts with the cheap one while it is accepted, and with the full one when
    the cheap one's drafts are rejected; plain steps when neither pays."""
    mem = GateMemory()
    g = Gate("auto", K, mem, "__base__", drafters=("", "/int4"))
    g.set_rows(["x", "y"])
    assert g.choose([50, 50]) == 0  # a plain step first
    g.observe(0, [0, 0], [True, True], None, verify_s=0.2)
    picks = []
    for _ in range(2):  # then one k = 1 cycle per drafter, each drafter's own cost
        k = g.choose([50, 50])
        picks.append((k, g.pick))
        g.observe(1, [1, 1], [True, True], draft_s=[0.1, 0.03][g.pick], verify_s=0.21)
    assert picks == [(1, 0), (1, 1)]
    for q in range(3, K + 2):
        mem.costs[("verify", g.shape, q)] = 0.2 + 0.01 * q
    for a_full, a_cheap, expect in ((0.9, 0.85, 1), (0.9, 0.05, 0)):
        mem.accepted.update({"x": 1000 * a_full, "y": 1000 * a_full,
                             ("x", "/int4"): 1000 * a_cheap, ("y", "/int4"): 1000 * a_cheap})
        mem.trials.update({key: 1000.0 for key in mem.accepted})
        assert g.choose([50, 50]) > 0 and g.pick == expect
    mem.costs[("draft", (2, "eager", torch.get_num_threads()))] = \
        mem.costs[("draft", (2, "eager/int4", torch.get_num_threads()))] = 1.0  # both far too dear
    assert g.choose([50, 50]) == 0


def test_verify_costs_are_the_same_whoever_drafted():
    """A verify pass runs LoRA on: its cost, measured under one drafter, is the cost under another (kept
    apart, the plain step's cost went stale under a drafter that drafted in every cycle)."""
    mem = GateMemory()
    full, cheap = Gate("auto", K, mem, "__base__"), Gate("auto", K, mem, "__base__", drafters=("/int4",))
    for g in (full, cheap):
        g.set_rows(["x", "y"])
    full.observe(0, [0, 0], [True, True], None, verify_s=0.3)
    cheap.observe(1, [1, 1], [True, True], draft_s=0.05, verify_s=0.31)
    assert cheap._costs()[0][:2] == pytest.approx([0.3, 0.36]) and full._costs()[0] is None  # no full draft timed


def test_a_cycle_that_measured_a_choice_teaches_acceptance_not_costs(monkeypatch):
    """A cycle during which a choice was measured or read (tuning.lookups grew: the first time a shape
    is met on a machine) took longer than its passes: the gate keeps its acceptance, not its times.
    Here every cycle looks so; the same calls with the count still record costs (the test has power)."""
    from hf_invisiblelora import tuning
    from hf_invisiblelora.model.state import state_of
    from tiny import prompts, tiny_peft

    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts([5, 7, 4])
    kw = dict(input_ids=ids, attention_mask=mask, adapter_names=["s", "b", "s"], do_sample=False, max_new_tokens=6,
              invisible_lora=True, gate="always", num_draft_tokens=2)
    count = iter(range(10**6))
    with monkeypatch.context() as m:
        m.setattr(tuning, "lookups", lambda: next(count))
        model.generate(**kw)
    memory = state_of(model).gate
    assert memory.trials and not memory.costs
    model.generate(**kw)
    assert any(key[0] == "verify" for key in memory.costs) and any(key[0] == "draft" for key in memory.costs)
