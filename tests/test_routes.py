"""The routes sweep: every way a user reaches a behaviour the option sweep covers, with invisible_lora=True.

tests/test_generation_options.py varies each generate() option as a generate() kwarg. A user reaches the
same behaviour by other routes, and each must give exactly stock PEFT generate()'s tokens (float64,
greedy or deterministic sampling) or be refused with a ValueError before any forward pass, leaving the
model as it was:

A. generation-config routes: a generate() kwarg; a field of a GenerationConfig passed as
   ``generation_config=``; a field of ``model.generation_config``; a passed GenerationConfig that leaves
   the field None while ``model.generation_config`` sets it; a kwarg over a config field (also to None,
   which switches the option off).
B. object routes: processors / criteria passed in ``logits_processor=`` / ``stopping_criteria=``: of the
   type of a default (stock keeps only the passed one), next to the defaults, a user criterion with an
   ``eos_token_id`` attribute (stock then pads the rows it stopped), MaxTimeCriteria expiring mid-call.
C. subclass routes: subclasses of Transformers' processors / criteria (user code: must be served), that
   only inherit, or that override ``__call__`` to read ``input_ids``.
D. PEFT adapter-state routes: disabled adapters (all layers, some layers), set_adapter, merge / unmerge,
   scaling edits, delete / re-add, add_weighted_adapter, hotswap, adapter dtypes, training mode / dropout,
   each also after a warm call (caches built before the state changed).
E. draft_vocab values that are not token ids of the vocabulary.
F. cache_implementation="paged" (stock switches to continuous batching before any custom decoding).

Each route whose effect should show is first checked to change stock's output (power), so a test
cannot pass vacuously.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from peft import LoraConfig
from peft.helpers import rescale_adapter_scale
from peft.tuners.lora import LoraLayer
from peft.utils.hotswap import hotswap_adapter
from test_generation_options import LENGTHS, ROWS, Ctx, Refused, _sequences, assert_same, snapshot as snap, standard
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation import logits_process as lp, stopping_criteria as sc

import hf_invisiblelora  # noqa: F401  (makes generate() accept invisible_lora=True)
from tiny import ADAPTERS, LINEAR, prompts, tiny_peft, tiny_tokenizer

NEW = 10
COMMON = dict(do_sample=False, max_new_tokens=NEW)
IDS, MASK = prompts(LENGTHS)
P = IDS.shape[1]
KS = [1, 3]


# ----------------------------------------------------------------------------- helpers


@functools.cache
def _proto():
    return tiny_peft("llama", strength=0.6)


@functools.cache
def _dropout_proto():
    """The same adapters with LoRA dropout 0.3: dropout in training mode really changes the output."""
    return tiny_peft("llama", strength=0.6, adapters={n: {**ADAPTERS[n], "lora_dropout": 0.3} for n in "sbcd"})


@functools.cache
def _strong_proto():
    """Stronger adapters: casting one to bfloat16 changes stock's tokens (at 0.6 it changes only logits)."""
    return tiny_peft("llama", strength=2.0)


@functools.cache
def _odd_scaling_proto():
    """Adapters whose scalings (alpha / r) are not powers of two: folding such a scaling into B rounds
    otherwise than PEFT's ``lora_B(lora_A(x)) * scaling`` in bfloat16 (a power of two scales exactly),
    which flipped tokens of these models when the bank computed bfloat16 adapters (even with gate="never")."""
    shapes = {"s": (3, 7), "b": (5, 11), "c": (2, 3), "d": (4, 5)}
    return tiny_peft("llama", strength=1.0, seed=1,
                     adapters={n: dict(r=r, lora_alpha=alpha, target_modules=LINEAR) for n, (r, alpha) in shapes.items()})


PROTOS = {"plain": _proto, "dropout": _dropout_proto, "strong": _strong_proto, "odd_scaling": _odd_scaling_proto}


def fresh(proto=None):
    """A model of its own for the invisible_lora call (no InvisibleLoRA state shared between tests)."""
    return copy.deepcopy(proto if proto is not None else _proto())


@functools.cache
def ctx() -> Ctx:
    return Ctx(IDS, MASK, standard(_proto(), IDS, MASK, ROWS, **COMMON))


@functools.cache
def tok():
    return tiny_tokenizer()


def _t(x):
    return int(x)


def E(c):
    """EOS ids the rows really produce early on: they stop rows 0 and 3 at different steps."""
    return [_t(c.new[0, 2]), _t(c.new[3, 1])]


def S1(c):
    return [tok().decode(c.new[2, 5:7].tolist()), tok().decode(c.new[1, 2:4].tolist())]


def S2(c):
    return [tok().decode(c.new[5, 2:4].tolist()), tok().decode(c.new[6, 3:5].tolist())]


@contextlib.contextmanager
def model_config(model, fields: dict):
    """``model.generation_config`` with ``fields`` set, restored after."""
    cfg = model.generation_config
    saved = {f: getattr(cfg, f, None) for f in fields}
    try:
        for f, v in fields.items():
            setattr(cfg, f, v)
        yield
    finally:
        for f, v in saved.items():
            setattr(cfg, f, v)


def ours(model, rows, k, gate="always", ids=IDS, mask=MASK, **kw):
    """invisible_lora generate(); a ValueError comes back as Refused (with the forward passes it ran first)."""
    calls = []
    hook = model.get_base_model().get_input_embeddings().register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        torch.manual_seed(0)
        return model.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, invisible_lora=True,
                              gate=gate, num_draft_tokens=k, **kw)
    except ValueError as e:
        return Refused(e, len(calls))
    finally:
        hook.remove()


def stock(model, rows=ROWS, ids=IDS, mask=MASK, **kw):
    torch.manual_seed(0)
    return _sequences(standard(model, ids, mask, rows, **kw))


def differs(a, b) -> bool:
    return a.shape != b.shape or not torch.equal(a, b)


def check(model, ref, rows, k, *, gate="always", must_serve=False, must_refuse=False, snap_rows="same",
          ids=IDS, mask=MASK, **kw):
    """invisible_lora gives ``ref`` (stock's tokens), or is refused before any forward pass, model unchanged."""
    srows = rows if snap_rows == "same" else snap_rows
    before = snap(model, ids, mask, srows)
    out = ours(model, rows, k, gate, ids, mask, **kw)
    if isinstance(out, Refused):
        assert not must_serve, f"refused, but this must be served: {out.error}"
        assert out.forwards == 0, f"refused after {out.forwards} forward passes: {out.error}"
        after = snap(model, ids, mask, srows)
        assert torch.equal(after.pop("logits"), before.pop("logits")), "the refused call changed the model's output"
        assert after == before, "the refused call left hooks / patched forwards / flags / scalings behind"
        return out
    assert not must_refuse, "served, but stock decodes this state differently (it must be refused)"
    names = rows if rows is not None else [model.active_adapters[0]] * ids.shape[0]
    assert_same(_sequences(out), ref, names)
    return out


def _power(route_out, references: dict):
    """Each reference (stock without the route, or with what the route overrides) gives other tokens."""
    same = [name for name, ref in references.items() if not differs(route_out, ref)]
    assert not same, f"no power: stock gives the same tokens with the route as {same}"


# ----------------------------------------------------------------------------- A. generation-config routes


@dataclass
class Opt:
    id: str
    value: Callable[[Ctx], dict]  # the config fields that set the option
    other: Callable[[Ctx], dict]  # other values of those fields (what an overriding route overrides)
    extra: Callable[[Ctx], dict] = lambda c: {}  # kwargs every route passes (tokenizer, the EOS it needs)
    common: dict = field(default_factory=lambda: dict(COMMON))
    baseline: Callable[[Ctx], dict] | None = None  # the call without the option (default: common + extra)
    off: bool = True  # field=None as a kwarg switches the option off (the "none_over_*" routes)


OPTS = [
    Opt("eos_token_id", lambda c: dict(eos_token_id=E(c)), lambda c: dict(eos_token_id=[_t(c.new[5, 3])])),
    Opt("pad_token_id", lambda c: dict(pad_token_id=7), lambda c: dict(pad_token_id=5),
        extra=lambda c: dict(eos_token_id=E(c))),
    Opt("max_new_tokens", lambda c: dict(max_new_tokens=6), lambda c: dict(max_new_tokens=9),
        common=dict(do_sample=False)),
    Opt("max_length", lambda c: dict(max_length=P + 5), lambda c: dict(max_length=P + 8),
        common=dict(do_sample=False), off=False),  # max_length=None: stock itself fails (a TypeError)
    Opt("min_new_tokens", lambda c: dict(min_new_tokens=5), lambda c: dict(min_new_tokens=2),
        extra=lambda c: dict(eos_token_id=E(c))),
    Opt("repetition_penalty", lambda c: dict(repetition_penalty=1.5), lambda c: dict(repetition_penalty=3.0)),
    Opt("no_repeat_ngram_size", lambda c: dict(no_repeat_ngram_size=2), lambda c: dict(no_repeat_ngram_size=1)),
    Opt("bad_words_ids",
        lambda c: dict(bad_words_ids=[[_t(c.new[0, 2])], [_t(c.new[3, 0]), _t(c.new[3, 1])], [_t(c.new[6, 3])]]),
        lambda c: dict(bad_words_ids=[[_t(c.new[1, 1])]])),
    Opt("suppress_tokens", lambda c: dict(suppress_tokens=[_t(c.new[0, 2]), _t(c.new[4, 1]), _t(c.new[5, 2])]),
        lambda c: dict(suppress_tokens=[_t(c.new[1, 0])])),
    Opt("stop_strings", lambda c: dict(stop_strings=S1(c)), lambda c: dict(stop_strings=S2(c)),
        extra=lambda c: dict(tokenizer=tok())),
    Opt("max_time", lambda c: dict(max_time=1e-6), lambda c: dict(max_time=1e6)),  # 1e-6: expired after 1 token
    Opt("do_sample_top_k_1", lambda c: dict(do_sample=True, top_k=1), lambda c: dict(do_sample=True, top_k=50),
        common=dict(max_new_tokens=NEW), baseline=lambda c: dict(max_new_tokens=NEW, do_sample=True), off=False),
]

ROUTES_A = ["kwarg", "config", "model_config", "config_leaves_none_model_sets", "kwarg_over_config",
            "kwarg_over_model_config", "none_over_config", "none_over_model_config"]


def route_call(opt: Opt, route: str, c: Ctx):
    """(kwargs, model.generation_config fields, the stock calls whose tokens the route must change)."""
    v, o, x, com = opt.value(c), opt.other(c), opt.extra(c), opt.common
    none = {f: None for f in v}
    return {
        "kwarg": ({**com, **x, **v}, {}, ["baseline"]),
        "config": ({**x, "generation_config": GenerationConfig(**com, **v)}, {}, ["baseline"]),
        "model_config": ({**com, **x}, v, ["baseline"]),
        "config_leaves_none_model_sets": ({**x, "generation_config": GenerationConfig(**com)}, v, ["baseline"]),
        "kwarg_over_config": ({**x, **v, "generation_config": GenerationConfig(**com, **o)}, {}, ["baseline", "other"]),
        "kwarg_over_model_config": ({**com, **x, **v}, o, ["baseline", "other"]),
        "none_over_config": ({**x, **none, "generation_config": GenerationConfig(**com, **v)}, {}, ["option"]),
        "none_over_model_config": ({**com, **x, **none}, v, ["option"]),
    }[route]


A_CASES = [(o, r) for o in OPTS for r in ROUTES_A if o.off or not r.startswith("none")]
_STOCK: dict = {}


def _stock_once(key, fn):
    if key not in _STOCK:
        _STOCK[key] = fn()
    return _STOCK[key]


def _stock_route(opt: Opt, route: str):
    def run():
        c = ctx()
        model = _proto()
        kwargs, fields, must_differ = route_call(opt, route, c)
        with model_config(model, fields):
            out = stock(model, **kwargs)
        x = opt.extra(c)
        refs = dict(
            baseline=lambda: stock(model, **(opt.baseline(c) if opt.baseline else {**opt.common, **x})),
            other=lambda: stock(model, **opt.common, **x, **opt.other(c)),
            option=lambda: stock(model, **opt.common, **x, **opt.value(c)),
        )
        _power(out, {name: _stock_once(("A-ref", opt.id, name), refs[name]) for name in must_differ})
        return out

    return _stock_once(("A", opt.id, route), run)


@pytest.mark.parametrize("opt,route", A_CASES, ids=[f"{o.id}-{r}" for o, r in A_CASES])
def test_generation_route_premise(opt, route):
    """Stock decodes the route, and the route changes stock's tokens."""
    _stock_route(opt, route)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("opt,route", A_CASES, ids=[f"{o.id}-{r}" for o, r in A_CASES])
def test_generation_route(opt, route, k):
    ref = _stock_route(opt, route)
    model = fresh()
    kwargs, fields, _ = route_call(opt, route, ctx())
    with model_config(model, fields):
        check(model, ref, ROWS, k, **kwargs)


# ----------------------------------------------------------------------------- B / C. object and subclass routes


class StopOnTokens(StoppingCriteria):
    """A user criterion: a row stops on one of ``tokens`` (no eos_token_id attribute)."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens.to(input_ids.device))


class StopOnTokensWithEosAttr(StopOnTokens):
    """The same, with an ``eos_token_id`` attribute: stock then pads the rows it stopped."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.eos_token_id = self.tokens


# (i) subclasses that only inherit: must behave as the parent.
class RepetitionPenaltySub(lp.RepetitionPenaltyLogitsProcessor):
    pass


class NoRepeatNGramSub(lp.NoRepeatNGramLogitsProcessor):
    pass


class SuppressTokensSub(lp.SuppressTokensLogitsProcessor):
    pass


class TopKSub(lp.TopKLogitsWarper):
    pass


class EosSub(sc.EosTokenCriteria):
    pass


class MaxLengthSub(sc.MaxLengthCriteria):
    pass


class StopStringSub(sc.StopStringCriteria):
    pass


# (ii) subclasses whose __call__ reads input_ids.
def _ban_last(input_ids, scores):
    scores = scores.clone()
    scores[torch.arange(scores.shape[0], device=scores.device), input_ids[:, -1]] = -math.inf
    return scores


class TemperatureBanLast(lp.TemperatureLogitsWarper):
    """A temperature warper that also bans each row's last token."""

    def __call__(self, input_ids, scores):
        return _ban_last(input_ids, super().__call__(input_ids, scores))


class TopKBanLast(lp.TopKLogitsWarper):
    """A top-k warper that first bans each row's last token."""

    def __call__(self, input_ids, scores):
        return super().__call__(input_ids, _ban_last(input_ids, scores))


class RecentRepetitionPenalty(lp.RepetitionPenaltyLogitsProcessor):
    """Penalizes only the last two tokens of each row."""

    def __call__(self, input_ids, scores):
        return super().__call__(input_ids[:, -2:], scores)


class EosAfterLength(sc.EosTokenCriteria):
    """EOS tokens count only once the batch is ``length`` tokens long."""

    def __init__(self, eos_token_id, length):
        super().__init__(eos_token_id)
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return super().__call__(input_ids, scores, **kwargs) & (input_ids.shape[-1] >= self.length)


class MaxLengthOrToken(sc.MaxLengthCriteria):
    """Max length, or per row: the last token is 0 mod 7."""

    def __call__(self, input_ids, scores, **kwargs):
        return super().__call__(input_ids, scores, **kwargs) | (input_ids[:, -1] % 7 == 0)


class MaxLengthEvenRows(sc.MaxLengthCriteria):
    """Max length, for the rows of even batch index only (reads the batch index and the length)."""

    def __call__(self, input_ids, scores, **kwargs):
        even = torch.arange(input_ids.shape[0], device=input_ids.device) % 2 == 0
        return super().__call__(input_ids, scores, **kwargs) & even


def _lp(*ps):
    return dict(logits_processor=LogitsProcessorList(list(ps)))


def _sc(*cs):
    return dict(stopping_criteria=StoppingCriteriaList(list(cs)))


def ES(c):
    """A token of every row, at different steps: every row stops (the batch ends early)."""
    return sorted({_t(c.new[r, 1 + r % 6]) for r in range(c.new.shape[0])})


def EA(c):
    """EOS ids that recur in rows 0, 1 and 3 (for the length-gated EOS criterion)."""
    return [_t(c.new[0, 3]), _t(c.new[1, 3]), _t(c.new[3, 4])]


@dataclass
class Obj:
    id: str
    kwargs: Callable[[Ctx], dict]  # on top of COMMON
    differ_from: tuple = (lambda c: {},)  # stock calls (on top of COMMON) the route must change
    custom: bool = False  # user code: must be served
    fields: Callable[[Ctx], dict] = lambda c: {}  # model.generation_config fields


OBJ_CASES = [
    # --- B: objects of a default's type (stock keeps only the passed one) ---------------------------
    Obj("eos_criteria_other_ids", lambda c: _sc(sc.EosTokenCriteria(E(c)))),
    Obj("eos_criteria_kwarg_eos_unset", lambda c: dict(eos_token_id=None, **_sc(sc.EosTokenCriteria(E(c)))),
        (lambda c: dict(eos_token_id=None),)),
    Obj("eos_criteria_model_config_eos_unset", lambda c: _sc(sc.EosTokenCriteria(E(c))),
        fields=lambda c: dict(eos_token_id=None)),
    Obj("max_length_criteria_shorter", lambda c: _sc(sc.MaxLengthCriteria(P + 5))),
    Obj("max_length_criteria_longer", lambda c: _sc(sc.MaxLengthCriteria(P + NEW + 4))),
    Obj("stop_string_criteria_replaces_stop_strings",
        lambda c: dict(stop_strings=S1(c), tokenizer=tok(), **_sc(sc.StopStringCriteria(tok(), S2(c)))),
        (lambda c: {}, lambda c: dict(stop_strings=S1(c), tokenizer=tok()))),
    Obj("stop_string_criteria_replaces_model_config_stop_strings",
        lambda c: dict(tokenizer=tok(), **_sc(sc.StopStringCriteria(tok(), S2(c)))),
        (lambda c: dict(tokenizer=tok()), lambda c: dict(tokenizer=tok(), stop_strings=None)),
        fields=lambda c: dict(stop_strings=S1(c))),
    Obj("repetition_penalty_object_replaces_kwarg",
        lambda c: dict(repetition_penalty=1.5, **_lp(lp.RepetitionPenaltyLogitsProcessor(3.0))),
        (lambda c: {}, lambda c: dict(repetition_penalty=1.5))),
    Obj("plain_python_lists", lambda c: dict(stopping_criteria=[sc.EosTokenCriteria(E(c))],
                                             logits_processor=[lp.RepetitionPenaltyLogitsProcessor(1.5)])),
    Obj("min_new_tokens_processor", lambda c: dict(eos_token_id=E(c), **_lp(lp.MinNewTokensLengthLogitsProcessor(
        P, 5, E(c)))), (lambda c: dict(eos_token_id=E(c)),)),
    Obj("min_new_tokens_processor_replaces_kwarg", lambda c: dict(
        eos_token_id=E(c), min_new_tokens=2, **_lp(lp.MinNewTokensLengthLogitsProcessor(P, 6, E(c)))),
        (lambda c: dict(eos_token_id=E(c)), lambda c: dict(eos_token_id=E(c), min_new_tokens=2))),
    # --- B: objects next to the defaults --------------------------------------------------------------
    Obj("stop_string_criteria_next_to_defaults", lambda c: dict(eos_token_id=E(c), **_sc(
        sc.StopStringCriteria(tok(), S2(c)))), (lambda c: dict(eos_token_id=E(c)),)),
    Obj("processors_next_to_defaults", lambda c: dict(repetition_penalty=1.5, **_lp(
        lp.NoRepeatNGramLogitsProcessor(2), lp.SuppressTokensLogitsProcessor([_t(c.new[2, 1])]))),
        (lambda c: dict(repetition_penalty=1.5),)),
    # --- B: user criteria and the eos_token_id attribute ----------------------------------------------
    Obj("custom_criterion_eos_attr_eos_unset", lambda c: dict(eos_token_id=None, **_sc(StopOnTokensWithEosAttr(ES(c)))),
        (lambda c: dict(eos_token_id=None), lambda c: dict(eos_token_id=None, **_sc(StopOnTokens(ES(c))))), custom=True),
    Obj("custom_criterion_eos_attr", lambda c: _sc(StopOnTokensWithEosAttr(E(c))), custom=True),
    Obj("custom_criterion_no_eos_attr_eos_unset", lambda c: dict(eos_token_id=None, **_sc(StopOnTokens(ES(c)))),
        (lambda c: dict(eos_token_id=None),), custom=True),
    # --- C (i): subclasses that only inherit ----------------------------------------------------------
    Obj("inherit_repetition_penalty", lambda c: _lp(RepetitionPenaltySub(1.5)), custom=True),
    Obj("inherit_no_repeat_ngram", lambda c: _lp(NoRepeatNGramSub(2)), custom=True),
    Obj("inherit_suppress_tokens", lambda c: _lp(SuppressTokensSub([_t(c.new[0, 2]), _t(c.new[4, 1])])), custom=True),
    Obj("inherit_top_k_sampling", lambda c: dict(do_sample=True, **_lp(TopKSub(1))),
        (lambda c: dict(do_sample=True),), custom=True),
    Obj("inherit_eos_criteria", lambda c: _sc(EosSub(E(c))), custom=True),
    Obj("inherit_eos_criteria_eos_unset", lambda c: dict(eos_token_id=None, **_sc(EosSub(E(c)))),
        (lambda c: dict(eos_token_id=None),), custom=True),
    Obj("inherit_max_length_criteria", lambda c: _sc(MaxLengthSub(P + 5)), custom=True),
    Obj("inherit_stop_string_criteria", lambda c: _sc(StopStringSub(tok(), S2(c))), custom=True),
    # --- C (ii): subclasses whose __call__ reads input_ids --------------------------------------------
    Obj("temperature_subclass_bans_last_token", lambda c: _lp(TemperatureBanLast(1.0)), custom=True),
    Obj("top_k_subclass_bans_last_token", lambda c: dict(do_sample=True, **_lp(TopKBanLast(1))),
        (lambda c: {}, lambda c: dict(do_sample=True)), custom=True),
    Obj("repetition_penalty_subclass_recent_tokens", lambda c: _lp(RecentRepetitionPenalty(3.0)),
        (lambda c: {}, lambda c: dict(repetition_penalty=3.0)), custom=True),
    Obj("eos_subclass_after_length", lambda c: _sc(EosAfterLength(EA(c), P + 4)),
        (lambda c: {}, lambda c: _sc(sc.EosTokenCriteria(EA(c))),), custom=True),
    Obj("eos_subclass_after_length_eos_unset", lambda c: dict(eos_token_id=None, **_sc(EosAfterLength(EA(c), P + 4))),
        (lambda c: dict(eos_token_id=None),), custom=True),
    Obj("max_length_subclass_stops_rows_on_token", lambda c: _sc(MaxLengthOrToken(P + NEW)), custom=True),
    Obj("max_length_subclass_even_rows", lambda c: _sc(MaxLengthEvenRows(P + 5)), custom=True),
]


def _stock_obj(case: Obj):
    def run():
        c, model = ctx(), _proto()
        with model_config(model, case.fields(c)):
            out = stock(model, **{**COMMON, **case.kwargs(c)})
            _power(out, {f"differ_from[{i}]": stock(model, **{**COMMON, **f(c)}) for i, f in enumerate(case.differ_from)})
        return out

    return _stock_once(("B", case.id), run)


@pytest.mark.parametrize("case", OBJ_CASES, ids=lambda c: c.id)
def test_object_route_premise(case):
    _stock_obj(case)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("case", OBJ_CASES, ids=lambda c: c.id)
def test_object_route(case, k):
    ref = _stock_obj(case)
    model, c = fresh(), ctx()
    with model_config(model, case.fields(c)):
        check(model, ref, ROWS, k, must_serve=case.custom, **{**COMMON, **case.kwargs(c)})


# --- B: MaxTimeCriteria expiring mid-call, on a deterministic clock


class Clock:
    """time.time() for transformers' stopping_criteria module: 0 for the first ``n`` calls, then far later."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def time(self):
        self.calls += 1
        return 0.0 if self.calls <= self.n else 1e9


MAX_TIME_ROUTES = {
    "max_time_kwarg": lambda: dict(max_time=100.0),  # generate() builds the criterion: its first clock call
    "max_time_criteria_object": lambda: _sc(sc.MaxTimeCriteria(100.0, initial_timestamp=0.0)),
}
TICKS = 6


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("route", MAX_TIME_ROUTES)
def test_max_time_expiring_mid_call(route, k, monkeypatch):
    """Stock stops every row at the step the time runs out; ours must give an output stock could give:
    every row cut at one common length, equal to stock's (untimed) tokens up to it."""
    full = ctx().free
    monkeypatch.setattr(sc, "time", Clock(TICKS))
    ref = stock(_proto(), **COMMON, **MAX_TIME_ROUTES[route]())
    assert P + 1 < ref.shape[1] < full.shape[1], f"premise: stock should stop mid-call, got {ref.shape[1] - P} tokens"
    assert torch.equal(ref, full[:, :ref.shape[1]]), "premise: stock's timed output is its untimed one, cut"
    model = fresh()
    before = snap(model, IDS, MASK, ROWS)
    monkeypatch.setattr(sc, "time", Clock(TICKS))
    out = ours(model, ROWS, k, **COMMON, **MAX_TIME_ROUTES[route]())
    if isinstance(out, Refused):
        assert out.forwards == 0, f"refused after {out.forwards} forward passes: {out.error}"
        after = snap(model, IDS, MASK, ROWS)
        assert torch.equal(after.pop("logits"), before.pop("logits")) and after == before
        return
    n = out.shape[1]
    assert P + 1 <= n <= full.shape[1], f"{n - P} new tokens"
    bad = [r for r in range(out.shape[0]) if out[r].tolist() != full[r, :n].tolist()]
    assert not bad, (f"no stock run gives this: cut at {n - P} new tokens, rows {bad} differ from stock's tokens "
                     f"up to there: row {bad[0]} ours {out[bad[0], P:].tolist()} stock {full[bad[0], P:n].tolist()}")


# ----------------------------------------------------------------------------- D. PEFT adapter-state routes


def lora_modules(model):
    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _cast(model, dtype, adapters=None):
    for m in lora_modules(model):
        for a in list(m.lora_A):
            if adapters is None or a in adapters:
                m.lora_A[a].to(dtype)
                m.lora_B[a].to(dtype)


def _add(model, name, kwargs, strength=0.6):
    model.add_adapter(name, LoraConfig(init_lora_weights=False, **kwargs))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if f"lora_B.{name}." in n:
                p.mul_(strength)
    model.eval()


def _replace(rows, mapping):
    return [mapping.get(r, r) for r in rows]


@functools.cache
def _hotswap_dir(tmp):
    """An adapter "x" (adapter s's config, other weights) saved to disk, to hotswap into "s"."""
    other = tiny_peft("llama", strength=0.6, seed=1, adapters={"x": ADAPTERS["s"]})
    other.save_pretrained(str(tmp))
    return str(tmp / "x")


def s_disable_adapter_ctx(m, stack, touch, env):
    stack.enter_context(m.disable_adapter())
    return ROWS


def s_disable_adapter_ctx_rows_none(m, stack, touch, env):
    stack.enter_context(m.disable_adapter())
    return None


def s_disable_adapter_layers(m, stack, touch, env):
    m.base_model.disable_adapter_layers()
    return ROWS


def s_disable_then_enable(m, stack, touch, env):
    m.base_model.disable_adapter_layers()
    touch()
    m.base_model.enable_adapter_layers()
    return ROWS


def s_some_layers_disabled(m, stack, touch, env):
    for layer in lora_modules(m)[::3]:
        layer.enable_adapters(False)
    return ROWS


def s_set_adapter_rows_none(m, stack, touch, env):
    m.set_adapter("b")
    return None


def s_active_adapter_rows_none(m, stack, touch, env):
    return None


def s_two_active_adapters_rows_none(m, stack, touch, env):
    m.base_model.set_adapter(["s", "d"])  # stock adds both adapters' deltas
    return None


def s_merged_rows_none(m, stack, touch, env):
    m.merge_adapter()
    return None


def s_merged_rows(m, stack, touch, env):
    m.merge_adapter()
    return ROWS


def s_unmerged(m, stack, touch, env):
    m.merge_adapter()
    touch()
    m.unmerge_adapter()
    return ROWS


def s_set_scale_all_layers(m, stack, touch, env):
    for layer in lora_modules(m):
        layer.set_scale("b", 2.5)
    return ROWS


def s_set_scale_some_layers(m, stack, touch, env):
    for layer in [x for x in lora_modules(m) if "s" in x.lora_A][::2]:
        layer.set_scale("s", 3.0)
    return ROWS


def s_rescale_adapter_scale_ctx(m, stack, touch, env):
    stack.enter_context(rescale_adapter_scale(m, 2.0))  # the active adapter ("s")
    return ROWS


def s_scale_layer_active(m, stack, touch, env):
    for layer in lora_modules(m):
        layer.scale_layer(0.3)  # the active adapter ("s")
    return ROWS


def s_scaling_dict_edit(m, stack, touch, env):
    for layer in lora_modules(m):
        if "d" in layer.scaling:
            layer.scaling["d"] = 0.25
    return ROWS


def s_weights_edited_in_place(m, stack, touch, env):
    with torch.no_grad():
        for layer in lora_modules(m):
            if "b" in layer.lora_B:
                layer.lora_B["b"].weight.mul_(-1.5)
    return ROWS


def s_delete_adapter(m, stack, touch, env):
    m.delete_adapter("c")
    return _replace(ROWS, {"c": "s"})


def s_delete_then_readd(m, stack, touch, env):
    m.delete_adapter("c")
    touch()
    _add(m, "c", dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    return ROWS


def s_weighted_cat(m, stack, touch, env):
    m.add_weighted_adapter(["s", "b"], [0.8, 0.6], "ab_cat", combination_type="cat")
    m.eval()
    return ["s", "ab_cat", "__base__", "c", "ab_cat", "s", "b"]


def s_weighted_linear(m, stack, touch, env):
    _add(m, "e", ADAPTERS["s"])  # the same rank and targets as "s" (linear needs them)
    m.add_weighted_adapter(["s", "e"], [0.7, 0.9], "ae_lin", combination_type="linear")
    m.eval()
    return ["s", "ae_lin", "__base__", "e", "d", "ae_lin", "b"]


def s_weighted_svd(m, stack, touch, env):
    m.add_weighted_adapter(["b", "d"], [0.7, 0.5], "bd_svd", combination_type="svd", svd_rank=4)
    m.eval()
    return ["s", "bd_svd", "__base__", "c", "bd_svd", "s", "b"]


def s_hotswap(m, stack, touch, env):
    hotswap_adapter(m, env["hotswap"], adapter_name="s", torch_device="cpu")
    return ROWS


def s_one_adapter_bf16(m, stack, touch, env):
    _cast(m, torch.bfloat16, {"b"})
    return ROWS


def s_all_adapters_bf16(m, stack, touch, env):
    _cast(m, torch.bfloat16)
    return ROWS


def s_all_adapters_fp32(m, stack, touch, env):
    _cast(m, torch.float32)
    return ROWS


def s_train_mode(m, stack, touch, env):
    m.train()
    return ROWS


def s_train_mode_rows_none(m, stack, touch, env):
    m.train()
    return None


def s_inner_model_train_mode(m, stack, touch, env):
    m.get_base_model().train()  # the PeftModel itself stays in eval mode
    return ROWS


def s_lora_dropout_train_mode(m, stack, touch, env):
    for layer in lora_modules(m):
        if "s" in layer.lora_dropout:
            layer.lora_dropout["s"].train()
    return ROWS


NEVER_AND_ALWAYS = (("never", 1), ("always", 1), ("always", 3))


@dataclass
class State:
    id: str
    setup: Callable  # (model, ExitStack, touch, env) -> adapter_names
    expect: str = "either"  # "serve" | "refuse" | "either"
    power: str = "pristine"  # "pristine", "base_rows" (the new adapters' rows as base), "logits", or why none
    proto: str = "plain"  # the model: "plain", "dropout" (LoRA dropout 0.3), "strong" (adapters at strength 2)
    snap_rows: str | None = "same"  # adapter_names of the snapshot forward (merged models take none)
    gates: tuple = (("always", 1), ("always", 3))


STATES = [
    State("disable_adapter_ctx", s_disable_adapter_ctx),
    State("disable_adapter_ctx_rows_none", s_disable_adapter_ctx_rows_none),
    State("disable_adapter_layers", s_disable_adapter_layers),
    State("disable_then_enable_adapter_layers", s_disable_then_enable,
          power="re-enabled: stock gives the pristine tokens (checks that nothing of the disabled state is kept)"),
    State("some_layers_disabled", s_some_layers_disabled),
    State("set_adapter_b_rows_none", s_set_adapter_rows_none),
    State("active_adapter_rows_none", s_active_adapter_rows_none, power="the plain adapter_names=None route"),
    State("two_active_adapters_rows_none", s_two_active_adapters_rows_none),
    State("merged_rows_none", s_merged_rows_none, expect="refuse", snap_rows=None,
          power="merging keeps the output; refused: the base model cannot draft"),
    State("merged_rows", s_merged_rows, expect="refuse", snap_rows=None,
          power="stock PEFT raises for adapter_names with merged adapters"),
    State("unmerged", s_unmerged, expect="serve", power="unmerged: stock gives the pristine tokens"),
    State("set_scale_all_layers", s_set_scale_all_layers),
    State("set_scale_some_layers", s_set_scale_some_layers),
    State("rescale_adapter_scale_ctx", s_rescale_adapter_scale_ctx),
    State("scale_layer_active", s_scale_layer_active),
    State("scaling_dict_edit", s_scaling_dict_edit),
    State("weights_edited_in_place", s_weights_edited_in_place),
    State("delete_adapter", s_delete_adapter, power="deleting c leaves the other rows' tokens as they were"),
    State("delete_then_readd", s_delete_then_readd),
    State("add_weighted_adapter_cat", s_weighted_cat, power="base_rows"),
    State("add_weighted_adapter_linear", s_weighted_linear, power="base_rows"),
    State("add_weighted_adapter_svd", s_weighted_svd, power="base_rows"),
    State("hotswap_adapter", s_hotswap),
    State("one_adapter_bf16", s_one_adapter_bf16, proto="strong", gates=NEVER_AND_ALWAYS),
    State("all_adapters_bf16", s_all_adapters_bf16, proto="strong", gates=NEVER_AND_ALWAYS),
    State("odd_scaling_all_adapters_bf16", s_all_adapters_bf16, proto="odd_scaling", gates=NEVER_AND_ALWAYS),
    State("odd_scaling_one_adapter_bf16", s_one_adapter_bf16, proto="odd_scaling", gates=NEVER_AND_ALWAYS),
    # float32 adapters on float64 change no token of these models (a logit check shows the cast is live)
    State("all_adapters_fp32", s_all_adapters_fp32, power="logits", gates=NEVER_AND_ALWAYS),
    State("train_mode", s_train_mode, expect="refuse", proto="dropout", snap_rows=None,
          power="stock PEFT itself raises for adapter_names in training mode"),
    State("train_mode_rows_none", s_train_mode_rows_none, expect="refuse", proto="dropout"),
    State("inner_model_train_mode", s_inner_model_train_mode, expect="refuse", proto="dropout"),
    State("lora_dropout_train_mode", s_lora_dropout_train_mode, expect="refuse", proto="dropout"),
]
NEW_ADAPTERS = {"ab_cat", "ae_lin", "e", "bd_svd"}
# "warm": an invisible_lora call before the state changes (caches built on the old state); refusals need no warm run
D_CASES = [(s, g, k, w) for s in STATES for g, k in s.gates for w in ("cold", "warm")
           if w == "cold" or s.expect != "refuse"]


def _stock_state(model, rows):
    return stock(model, rows, **COMMON)


def _state_power(state: State, model, rows, ref):
    """Stock's tokens (or logits) in the state differ from stock's without it."""
    if state.power in ("pristine", "base_rows", "logits"):
        if state.power == "pristine":
            other = _stock_state(fresh(PROTOS[state.proto]()), rows)
            assert ref is not None and differs(ref, other), "no power: stock gives the pristine tokens in this state"
        elif state.power == "base_rows":
            other = _stock_state(model, _replace(rows, {a: "__base__" for a in NEW_ADAPTERS}))
            assert differs(ref, other), "no power: the new adapter's rows decode as base rows"
        else:
            with torch.no_grad():
                a = model(input_ids=IDS, attention_mask=MASK, adapter_names=rows).logits
                b = fresh(PROTOS[state.proto]())(input_ids=IDS, attention_mask=MASK, adapter_names=rows).logits
            assert not torch.equal(a, b), "no power: the cast changes no logit"


_POWER_DONE: set = set()


@pytest.mark.parametrize("state,gate,k,warm", D_CASES, ids=[f"{s.id}-{g}{k}-{w}" for s, g, k, w in D_CASES])
def test_adapter_state_route(state, gate, k, warm, tmp_path_factory):
    env = dict(hotswap=_hotswap_dir(tmp_path_factory.getbasetemp() / "hotswap"))
    model = fresh(PROTOS[state.proto]())

    def touch():  # an invisible_lora call on the model as it is now (builds / reuses its caches)
        ours(model, ROWS, k, gate, **COMMON)

    if warm == "warm":
        touch()
    with contextlib.ExitStack() as stack:
        rows = state.setup(model, stack, touch, env)
        ref = None  # stock in the state (the same for every gate and warm-up: computed once)
        if state.expect != "refuse" or state.power == "pristine":
            ref = _stock_once(("D", state.id), lambda: _stock_state(model, rows))
        if state.id not in _POWER_DONE:
            _state_power(state, model, rows, ref)
            _POWER_DONE.add(state.id)
        check(model, ref, rows, k, gate=gate, must_serve=state.expect == "serve",
              must_refuse=state.expect == "refuse", snap_rows=rows if state.snap_rows == "same" else None, **COMMON)


# ----------------------------------------------------------------------------- E. draft_vocab validation

BAD_DRAFT_VOCABS = {
    "id_past_vocab": lambda: [2, 5, 64],
    "far_past_vocab": lambda: [3, 1000],
    "negative_id": lambda: [-1, 3, 4],
    "empty_list": lambda: [],
    "float_tensor": lambda: torch.tensor([2.0, 3.0, 5.0]),
    "two_d_tensor": lambda: torch.tensor([[2, 3], [4, 5]]),
}


@pytest.mark.parametrize("name", BAD_DRAFT_VOCABS)
def test_draft_vocab_invalid_is_refused_up_front(name):
    model = fresh()
    before = snap(model, IDS, MASK, ROWS)
    out = ours(model, ROWS, 3, draft_vocab=BAD_DRAFT_VOCABS[name](), **COMMON)
    assert isinstance(out, Refused), "an invalid draft_vocab was served"
    assert out.forwards == 0, f"refused after {out.forwards} forward passes: {out.error}"
    after = snap(model, IDS, MASK, ROWS)
    assert torch.equal(after.pop("logits"), before.pop("logits")) and after == before


@pytest.mark.parametrize("vocab", [list(range(64)), list(range(2, 40)), torch.arange(10, 60)],
                         ids=["whole_vocab", "list", "tensor"])
def test_draft_vocab_valid_is_served(vocab):
    """The route works at all (so the refusals above are about the values)."""
    check(fresh(), ctx().free, ROWS, 3, must_serve=True, draft_vocab=vocab, **COMMON)


# ----------------------------------------------------------------------------- F. cache_implementation="paged"


def test_paged_cache_kwarg_refused_or_exact():
    """Stock's generate() switches to continuous batching on cache_implementation="paged" (a kwarg) before
    any custom decoding: invisible_lora must refuse it up front or give each row its adapter's tokens."""
    model = fresh()
    check(model, ctx().free, ROWS, 3, cache_implementation="paged", **COMMON)


def test_paged_cache_in_generation_config():
    """As a GenerationConfig field stock does not switch (it checks the kwarg): it decodes as usual."""
    ref = _stock_once(("F", "config"), lambda: stock(_proto(), generation_config=GenerationConfig(
        cache_implementation="paged", **COMMON)))
    check(fresh(), ref, ROWS, 3, generation_config=GenerationConfig(cache_implementation="paged", **COMMON))
