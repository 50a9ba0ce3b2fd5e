"""Every generate() option that reaches a logits processor or a stopping criterion, with invisible_lora=True.

The catalog (tests/options_catalog.py) classifies every LogitsProcessor / StoppingCriteria class of
``transformers.generation``; a class it does not know fails ``test_catalog_is_complete``. Then:

* greedy sweep: each option on a mixed-adapter, left-padded batch (float64) gives exactly standard
  PEFT decoding's tokens, or is refused with a ValueError before any forward pass, leaving the model
  as it was. Each option is checked to reach its class (a spy on standard decoding) and to change
  standard decoding's output (the test has power), unless stated why it cannot.
* custom processors / criteria that read the batch index, ``input_ids.shape[-1]`` or the scores.
* inputs that are not plain left padding: right padding, a mask with a hole, explicit
  ``position_ids``, int32 ``input_ids``, no attention mask.
* sampling: the warpers and the repetition penalty keep the target distribution (chi-square against
  exact enumeration, with a power check against the distribution without the option).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from options_catalog import CATALOG, enumerate_classes
from peft.tuners.lora import LoraLayer
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    SynthIDTextWatermarkingConfig,
    WatermarkingConfig,
)
from transformers.generation import logits_process as lp

import hf_invisiblelora  # noqa: F401  (makes generate() accept invisible_lora=True)
from tiny import EOS, PAD, chi_square_p, prompts, tiny_peft, tiny_tokenizer

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]
LENGTHS = [5, 9, 3, 7, 9, 1, 6]
NEW = 14
V = 64


# ----------------------------------------------------------------------------- catalog


def test_catalog_is_complete():
    """A class Transformers adds (or drops) must be classified in tests/options_catalog.py."""
    found = set(enumerate_classes())
    missing, stale = sorted(found - set(CATALOG)), sorted(set(CATALOG) - found)
    assert not missing, f"unclassified generation classes, add them to tests/options_catalog.py: {missing}"
    assert not stale, f"classes no longer in transformers.generation: {stale}"
    assert all(e.kind in ("generate", "direct", "base", "n/a") for e in CATALOG.values())
    assert all(e.kwargs is not None for e in CATALOG.values() if e.kind == "generate")


class _Spy:
    """Records the classes of the processors and criteria standard decoding (``_sample``) is handed."""

    def __init__(self, model):
        self.cls = type(model.get_base_model() if hasattr(model, "get_base_model") else model)
        self.built: set[str] = set()

    def __enter__(self):
        self.mp = pytest.MonkeyPatch()
        original = self.cls._sample

        def spy(inner, input_ids, logits_processor, stopping_criteria, generation_config, **kw):
            self.built.update(type(p).__name__ for p in logits_processor)
            self.built.update(type(c).__name__ for c in stopping_criteria)
            return original(inner, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                            generation_config=generation_config, **kw)

        self.mp.setattr(self.cls, "_sample", spy)
        return self

    def __exit__(self, *exc):
        self.mp.undo()


@pytest.mark.parametrize("name", sorted(n for n, e in CATALOG.items() if e.kind == "generate"))
def test_catalog_kwargs_build_the_class(name):
    """The catalog's generate() kwargs for a class really make standard decoding use that class."""
    model = tiny_peft("llama", adapters=("s",)).get_base_model()
    ids, mask = prompts([4, 6])
    with _Spy(model) as spy:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **CATALOG[name].kwargs())
    assert name in spy.built, f"{CATALOG[name].detail}: generate built {sorted(spy.built)}"


def test_every_applicable_class_is_exercised():
    covered = {c for case in GREEDY_CASES for c in case.covers} | {c for s in SAMPLING for c in s.covers}
    needed = {n for n, e in CATALOG.items() if e.kind in ("generate", "direct")}
    assert not needed - covered, f"no test exercises {sorted(needed - covered)}"


# ----------------------------------------------------------------------------- helpers


def snapshot(model, ids, mask, rows):
    """Everything a refused call could leave changed: a mixed-adapter forward (``rows``: its
    adapter_names, None for none; seeded, so that a model with dropout in training mode gives the
    same logits again), hooks, patched forwards, flags, PEFT's adapter state, dtypes."""
    torch.manual_seed(1234)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, adapter_names=rows).logits
    modules = list(model.modules())
    lora = [m for m in modules if isinstance(m, LoraLayer)]
    return dict(
        logits=logits,
        hooks=[len(m._forward_pre_hooks) + len(m._forward_hooks) for m in modules],
        forwards=["forward" in vars(m) for m in modules],
        disabled=[getattr(m, "_disable_adapters", None) for m in modules],
        grad=[p.requires_grad for p in model.parameters()],
        training=[m.training for m in modules],
        active=list(model.active_adapters),
        merged=[list(m.merged_adapters) for m in lora],
        scaling=[dict(m.scaling) for m in lora],
        dtypes=[p.dtype for p in model.parameters()],
        adapters=list(model.peft_config),
    )


def assert_unchanged(model, before, ids, mask, rows):
    after = snapshot(model, ids, mask, rows)
    assert torch.equal(after.pop("logits"), before.pop("logits")), "the refused call changed the model's output"
    assert after == before, "the refused call left hooks / patched forwards / flags behind"


class Refused:
    def __init__(self, error, forwards):
        self.error, self.forwards = error, forwards


def invisible(model, ids, mask, rows, k, **kw):
    """invisible_lora generate(); a ValueError comes back as Refused (with the forward passes it ran first)."""
    calls = []
    hook = model.get_base_model().get_input_embeddings().register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        return model.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, invisible_lora=True,
                              gate="always", num_draft_tokens=k, **kw)
    except ValueError as e:
        return Refused(e, len(calls))
    finally:
        hook.remove()


def standard(model, ids, mask, rows, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, **kw)


def assert_same(out, ref, rows):
    assert not isinstance(out, Refused), f"refused: {out.error}"
    for r in range(ref.shape[0]):
        got, want = out[r].tolist(), ref[r].tolist()
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(f"row {r} ({rows[r * len(rows) // ref.shape[0]]}) differs from standard decoding at "
                                 f"column {at}:\n  invisible {got[at:]}\n  standard  {want[at:]}")
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != standard {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"dtype {out.dtype} != standard {ref.dtype}"


# ----------------------------------------------------------------------------- greedy sweep


@dataclass
class Ctx:
    """The default batch and standard decoding's output without options (``new``: the generated part)."""

    ids: torch.Tensor
    mask: torch.Tensor
    free: torch.Tensor

    @property
    def p(self):
        return self.ids.shape[1]

    @property
    def new(self):
        return self.free[:, self.p:]


@dataclass
class Case:
    id: str
    covers: tuple[str, ...]  # classes standard decoding must build for this option
    kwargs: Callable[[Ctx], dict]  # the option (built afresh per call: processors may hold state)
    baseline: Callable[[Ctx], dict] = lambda c: {}  # the same call without the option (for the power check)
    no_power: str | None = None  # why the option cannot change the output
    inputs: Callable[[], tuple] | None = None  # (ids, mask) other than the default batch
    custom: bool = False  # user code: must be served (no refusal)
    common: dict = field(default_factory=lambda: dict(do_sample=False, max_new_tokens=NEW))


class BanForRows(LogitsProcessor):
    """Bans token ``t`` for batch row ``r`` (reads the batch index)."""

    def __init__(self, bans: dict[int, int]):
        self.bans = bans

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for r, t in self.bans.items():
            scores[r, t] = -math.inf
        return scores


class LengthBias(LogitsProcessor):
    """Adds a bias that depends on ``input_ids.shape[-1]``."""

    def __call__(self, input_ids, scores):
        n = input_ids.shape[-1]
        return scores + 3.0 * torch.cos(torch.arange(scores.shape[-1], dtype=scores.dtype) * n).to(scores.device)


class CloseCallToSecond(LogitsProcessor):
    """Reads the scores: where the best token leads the second by less than ``margin``, the second wins."""

    def __init__(self, margin=0.5):
        self.margin = margin

    def __call__(self, input_ids, scores):
        top = scores.topk(2, -1)
        close = (top.values[:, 0] - top.values[:, 1]) < self.margin
        scores = scores.clone()
        rows = close.nonzero()[:, 0]
        scores[rows, top.indices[rows, 0]] = top.values[rows, 1] - 1.0
        return scores


class StopAtLength(StoppingCriteria):
    """Reads ``input_ids.shape[-1]``: a row stops once the batch is ``length`` long and its last token is 0 mod 3."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -1] % 3 == 0) & (input_ids.shape[-1] >= self.length)


class StopOnScores(StoppingCriteria):
    """Reads ``scores``: standard decoding passes None unless output_scores (then the tuple of processed scores)."""

    def __init__(self, tokens, threshold=0.2):
        self.tokens, self.threshold = torch.tensor(tokens), threshold

    def __call__(self, input_ids, scores, **kwargs):
        if scores is None:
            return torch.isin(input_ids[:, -1], self.tokens.to(input_ids.device))
        return scores[-1].softmax(-1).max(-1).values < self.threshold


def _t(x):
    return int(x)


def _eos_early(c):
    """Two tokens the rows really produce early on: as EOS ids they stop rows at different steps."""
    return [_t(c.new[0, 2]), _t(c.new[3, 1])]


def _stop_strings(c):
    tok = tiny_tokenizer()
    return dict(stop_strings=[tok.decode(c.new[2, 5:7].tolist()), tok.decode(c.new[1, 2:4].tolist())], tokenizer=tok)


def _width_one():
    return prompts([1] * 7, seed=1)


GREEDY_CASES = [
    # generate() kwargs -------------------------------------------------------------------------
    Case("repetition_penalty", ("RepetitionPenaltyLogitsProcessor",), lambda c: dict(repetition_penalty=1.5)),
    Case("no_repeat_ngram_size", ("NoRepeatNGramLogitsProcessor",), lambda c: dict(no_repeat_ngram_size=2)),
    Case("encoder_repetition_penalty", ("EncoderRepetitionPenaltyLogitsProcessor",),
         lambda c: dict(encoder_repetition_penalty=3.0)),
    Case("encoder_no_repeat_ngram_size", ("EncoderNoRepeatNGramLogitsProcessor",),
         lambda c: dict(encoder_no_repeat_ngram_size=1)),
    Case("bad_words_ids", ("NoBadWordsLogitsProcessor",),
         lambda c: dict(bad_words_ids=[[_t(c.new[0, 2])], [_t(c.new[3, 0]), _t(c.new[3, 1])], [_t(c.new[6, 3])]])),
    Case("sequence_bias", ("SequenceBiasLogitsProcessor",),
         lambda c: dict(sequence_bias=[[[_t(c.new[1, 1])], -4.0], [[_t(c.new[6, 0]), _t(c.new[6, 1])], -6.0],
                                       [[_t(c.new[2, 3])], 2.5]])),
    Case("min_length", ("MinLengthLogitsProcessor", "EosTokenCriteria"),
         lambda c: dict(eos_token_id=_eos_early(c), min_length=c.p + 6),
         baseline=lambda c: dict(eos_token_id=_eos_early(c))),
    Case("min_new_tokens", ("MinNewTokensLengthLogitsProcessor", "EosTokenCriteria"),
         lambda c: dict(eos_token_id=_eos_early(c), min_new_tokens=5),
         baseline=lambda c: dict(eos_token_id=_eos_early(c))),
    Case("exponential_decay_length_penalty", ("ExponentialDecayLengthPenalty",),
         lambda c: dict(exponential_decay_length_penalty=(3, 2.0), eos_token_id=EOS)),
    Case("suppress_tokens", ("SuppressTokensLogitsProcessor",),
         lambda c: dict(suppress_tokens=[_t(c.new[0, 2]), _t(c.new[4, 1]), _t(c.new[5, 2])])),
    Case("begin_suppress_tokens", ("SuppressTokensAtBeginLogitsProcessor",),
         lambda c: dict(begin_suppress_tokens=sorted({_t(x) for x in c.new[:, 0]}))),
    Case("forced_bos_token_id", ("ForcedBOSTokenLogitsProcessor",), lambda c: dict(forced_bos_token_id=7),
         inputs=_width_one),
    Case("forced_eos_token_id", ("ForcedEOSTokenLogitsProcessor",), lambda c: dict(forced_eos_token_id=7)),
    Case("remove_invalid_values", ("InfNanRemoveLogitsProcessor",),
         lambda c: dict(remove_invalid_values=True, sequence_bias=[[[_t(c.new[1, 0])], math.nan]]),
         baseline=lambda c: dict(sequence_bias=[[[_t(c.new[1, 0])], math.nan]])),
    Case("renormalize_logits", ("LogitNormalization",), lambda c: dict(renormalize_logits=True),
         no_power="log_softmax keeps the argmax (and the sampling distribution): no effect on tokens"),
    Case("guidance_scale", ("UnbatchedClassifierFreeGuidanceLogitsProcessor",), lambda c: dict(guidance_scale=1.5)),
    Case("guidance_scale_negative_prompt", ("UnbatchedClassifierFreeGuidanceLogitsProcessor",),
         lambda c: dict(guidance_scale=2.0, negative_prompt_ids=prompts([2, 3, 1, 3, 2, 2, 3], seed=5)[0],
                        negative_prompt_attention_mask=prompts([2, 3, 1, 3, 2, 2, 3], seed=5)[1])),
    Case("watermark_lefthash", ("WatermarkLogitsProcessor",),
         lambda c: dict(watermarking_config=WatermarkingConfig(bias=4.0, context_width=2))),
    Case("watermark_selfhash", ("WatermarkLogitsProcessor",),
         lambda c: dict(watermarking_config=WatermarkingConfig(bias=4.0, seeding_scheme="selfhash"))),
    Case("synthid_watermark", ("SynthIDTextWatermarkLogitsProcessor",),
         lambda c: dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443],
                                                                          ngram_len=3))),
    Case("max_length", ("MaxLengthCriteria",), lambda c: dict(max_length=c.p + 9, max_new_tokens=None)),
    Case("max_time", ("MaxTimeCriteria",), lambda c: dict(max_time=1e-6)),  # expired after the first token
    Case("stop_strings", ("StopStringCriteria",), _stop_strings),
    Case("eos_token_id_list", ("EosTokenCriteria",), lambda c: dict(eos_token_id=[_t(c.new[0, 3]), _t(c.new[3, 5])])),
    # model-specific but generic processors, passed directly ----------------------------------
    Case("alternating_codebooks", ("AlternatingCodebooksLogitsProcessor",),
         lambda c: dict(logits_processor=LogitsProcessorList(
             [lp.AlternatingCodebooksLogitsProcessor(input_start_len=c.p, semantic_vocab_size=20, codebook_size=20)]))),
    Case("bark_eos_prioritizer", ("BarkEosPrioritizerLogitsProcessor", "EosTokenCriteria"),
         lambda c: dict(eos_token_id=_t(c.new[1, 3]), logits_processor=LogitsProcessorList(
             [lp.BarkEosPrioritizerLogitsProcessor(eos_token_id=_t(c.new[1, 3]), min_eos_p=0.01)])),
         baseline=lambda c: dict(eos_token_id=_t(c.new[1, 3]))),
    # warpers, made deterministic (one token left): sampling must then give these exact tokens ---
    *[Case(f"sampling_{name}", (cls,), lambda c, kw=kw: dict(do_sample=True, **kw),
           baseline=lambda c: dict(do_sample=True))
      for name, cls, kw in [
          ("top_k_1", "TopKLogitsWarper", dict(top_k=1)),
          ("top_p_tiny", "TopPLogitsWarper", dict(top_p=1e-3)),
          ("min_p_1", "MinPLogitsWarper", dict(min_p=1.0)),
          ("typical_p_tiny", "TypicalLogitsWarper", dict(typical_p=1e-3)),  # the most typical token, not the argmax
          ("epsilon_cutoff_high", "EpsilonLogitsWarper", dict(epsilon_cutoff=0.9)),
          ("top_h_tiny", "TopHLogitsWarper", dict(top_h=0.01)),
      ]],
    # user processors and criteria that read what standard decoding shows them ------------------
    Case("custom_batch_index_processor", ("BanForRows",),
         lambda c: dict(logits_processor=LogitsProcessorList([BanForRows({0: _t(c.new[0, 2]),
                                                                          6: _t(c.new[6, 1])})])), custom=True),
    Case("custom_prefix_allowed_tokens_fn_batch_id", ("PrefixConstrainedLogitsProcessor",),
         lambda c: dict(prefix_allowed_tokens_fn=lambda batch_id, sent: [
             t for t in range(2, V) if t % 4 != batch_id % 4 and t != int(sent[-1])]),
         custom=True),
    Case("custom_length_processor", ("LengthBias",),
         lambda c: dict(logits_processor=LogitsProcessorList([LengthBias()])), custom=True),
    Case("custom_length_criterion", ("StopAtLength",),
         lambda c: dict(stopping_criteria=StoppingCriteriaList([StopAtLength(c.p + 4)])), custom=True),
    Case("custom_scores_processor", ("CloseCallToSecond",),
         lambda c: dict(logits_processor=LogitsProcessorList([CloseCallToSecond()])), custom=True),
    Case("custom_scores_criterion", ("StopOnScores",),
         lambda c: dict(stopping_criteria=StoppingCriteriaList([StopOnScores([_t(c.new[0, 3]), _t(c.new[4, 5])])])),
         custom=True),
    # with output_scores standard decoding hands the criterion the scores: serve it or refuse it
    Case("custom_scores_criterion_output_scores", ("StopOnScores",),
         lambda c: dict(stopping_criteria=StoppingCriteriaList([StopOnScores([], threshold=0.1)]),
                        output_scores=True, return_dict_in_generate=True)),
]

_STOCK: dict[str, tuple] = {}  # case id -> (ids, mask, standard output): standard decoding runs once per case


def _sequences(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


def _stock(case):
    if case.id not in _STOCK:
        model = tiny_peft("llama", strength=0.6)
        ids, mask = case.inputs() if case.inputs else prompts(LENGTHS)
        free = standard(model, ids, mask, ROWS, **case.common)
        ctx = Ctx(ids, mask, free)
        torch.manual_seed(0)
        with _Spy(model) as spy:
            ref = _sequences(standard(model, ids, mask, ROWS, **{**case.common, **case.kwargs(ctx)}))
        missing = set(case.covers) - spy.built
        assert not missing, f"the option did not reach {missing} (built: {sorted(spy.built)})"
        if case.no_power is None:
            torch.manual_seed(0)
            base = _sequences(standard(model, ids, mask, ROWS, **{**case.common, **case.baseline(ctx)}))
            assert base.shape != ref.shape or not torch.equal(base, ref), "no power: the option changes nothing"
        _STOCK[case.id] = (ctx, ref)
    return _STOCK[case.id]


@pytest.mark.parametrize("case", GREEDY_CASES, ids=lambda c: c.id)
def test_option_reaches_class_and_changes_standard_output(case):
    """The test's own premise, checked on standard decoding alone."""
    _stock(case)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", GREEDY_CASES, ids=lambda c: c.id)
def test_greedy_option_identical_or_refused(case, k):
    ctx, ref = _stock(case)
    model = tiny_peft("llama", strength=0.6)
    before = snapshot(model, ctx.ids, ctx.mask, ROWS)
    torch.manual_seed(0)
    out = invisible(model, ctx.ids, ctx.mask, ROWS, k, **{**case.common, **case.kwargs(ctx)})
    if isinstance(out, Refused):
        assert not case.custom, f"a user processor / criterion was refused: {out.error}"
        assert out.forwards == 0, f"refused after {out.forwards} forward passes: {out.error}"
        assert_unchanged(model, before, ctx.ids, ctx.mask, ROWS)
        return
    assert_same(_sequences(out), ref, ROWS)


def test_prefix_allowed_tokens_fn_batch_id_with_num_return_sequences():
    """With num_return_sequences=2, standard decoding's batch_id is row // 2 (deterministic sampling: top_k=1)."""

    def allowed(batch_id, sent):
        return [t for t in range(2, V) if t % 3 != batch_id % 3]

    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    # The reference: the rows expanded by hand, batch_id mapped as num_return_sequences=2 maps it.
    ref = standard(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), [n for n in ROWS for _ in "xx"],
                   do_sample=False, max_new_tokens=NEW, prefix_allowed_tokens_fn=lambda b, s: allowed(b // 2, s))
    plain = standard(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), [n for n in ROWS for _ in "xx"],
                     do_sample=False, max_new_tokens=NEW)
    assert not torch.equal(ref, plain)
    # The premise, on the base model (PEFT's own generate cannot combine adapter_names with num_return_sequences):
    # num_return_sequences=2 gives what the hand expansion with batch_id // 2 gives.
    with model.disable_adapter():
        inner = model.get_base_model()
        by_hand = inner.generate(ids.repeat_interleave(2, 0), attention_mask=mask.repeat_interleave(2, 0),
                                 do_sample=False, max_new_tokens=NEW,
                                 prefix_allowed_tokens_fn=lambda b, s: allowed(b // 2, s))
        torch.manual_seed(0)
        expanded = inner.generate(ids, attention_mask=mask, do_sample=True, top_k=1, num_return_sequences=2,
                                  max_new_tokens=NEW, prefix_allowed_tokens_fn=allowed)
    assert torch.equal(by_hand, expanded)
    for k in (1, 3):
        torch.manual_seed(0)
        out = invisible(model, ids, mask, ROWS, k, do_sample=True, top_k=1, num_return_sequences=2,
                        max_new_tokens=NEW, prefix_allowed_tokens_fn=allowed)
        assert_same(out, ref, [n for n in ROWS for _ in "xx"])


# ----------------------------------------------------------------------------- inputs


def _right_padded():
    ids, mask = prompts(LENGTHS)
    r_ids, r_mask = torch.full_like(ids, PAD), torch.zeros_like(mask)
    for i, n in enumerate(LENGTHS):
        r_ids[i, :n], r_mask[i, :n] = ids[i, ids.shape[1] - n:], 1
    return dict(input_ids=r_ids, attention_mask=r_mask)


def _mask_with_hole():
    ids, mask = prompts(LENGTHS)
    mask = mask.clone()
    for i, n in enumerate(LENGTHS):
        if n >= 5:
            mask[i, ids.shape[1] - n + 2] = 0  # a token in the middle of the prompt is masked out
    return dict(input_ids=ids, attention_mask=mask)


def _position_ids():
    ids, mask = prompts(LENGTHS)
    default = (mask.cumsum(-1) - 1).clamp(min=0)
    return dict(input_ids=ids, attention_mask=mask, position_ids=default * 2)  # stretched positions


def _int32():
    ids, mask = prompts(LENGTHS)
    return dict(input_ids=ids.int(), attention_mask=mask)


def _no_mask():
    ids, _ = prompts(LENGTHS)  # left-padded with PAD: generate() infers the mask from pad_token_id
    return dict(input_ids=ids)


INPUTS = {"right_padding": _right_padded, "mask_with_hole": _mask_with_hole, "position_ids": _position_ids,
          "int32_input_ids": _int32, "no_attention_mask": _no_mask}


@pytest.mark.parametrize("name", INPUTS)
def test_inputs_premise(name):
    """Standard decoding takes these inputs, and (where they mean something else) decodes differently."""
    model = tiny_peft("llama", strength=0.6)
    ref = model.generate(**INPUTS[name](), adapter_names=ROWS, do_sample=False, max_new_tokens=NEW)
    ids, mask = prompts(LENGTHS)
    plain = standard(model, ids, mask, ROWS, do_sample=False, max_new_tokens=NEW)
    if name in ("right_padding", "mask_with_hole", "position_ids"):
        assert not (ref.shape == plain.shape and torch.equal(ref, plain))
    else:  # the same prompts, said differently
        assert ref.tolist() == plain.tolist()


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", INPUTS)
def test_inputs_beyond_left_padding(name, k):
    model = tiny_peft("llama", strength=0.6)
    inputs = INPUTS[name]()
    ref = model.generate(**inputs, adapter_names=ROWS, do_sample=False, max_new_tokens=NEW)
    out = model.generate(**inputs, adapter_names=ROWS, do_sample=False, max_new_tokens=NEW, invisible_lora=True,
                         gate="always", num_draft_tokens=k)
    assert_same(out, ref, ROWS)


# ----------------------------------------------------------------------------- sampling

SVOCAB, SN, SB = 8, 2400, 1600  # vocab; rows per call, of which the first SB use adapter "b" (the rest: base)
SUPPRESS = [0, 1]  # pad and EOS never sampled, so every row generates exactly STEPS tokens
STEPS = 3
PROMPT = torch.tensor([[5, 2, 7, 3]])


@dataclass
class Sampling:
    id: str
    covers: tuple[str, ...]
    kwargs: dict
    processors: Callable[[], list]  # what generate() builds for suppress_tokens + kwargs, in its order
    k: int


def _warped(cls, value):
    # generate() also adds TopK(50) (generation_config's default top_k) after the temperature: a no-op on 8
    # tokens, left out here (test_sampling_processor_list_matches_generate checks the rest of the list)
    return lambda: [lp.SuppressTokensLogitsProcessor(SUPPRESS), cls(value)]


_WARPERS = [  # generate() kwarg, value, the class it builds, num_draft_tokens
    ("temperature", 0.5, lp.TemperatureLogitsWarper, 1),
    ("top_k", 3, lp.TopKLogitsWarper, 3),
    ("top_p", 0.8, lp.TopPLogitsWarper, 1),
    ("min_p", 0.3, lp.MinPLogitsWarper, 3),
    ("typical_p", 0.8, lp.TypicalLogitsWarper, 1),
    ("epsilon_cutoff", 0.1, lp.EpsilonLogitsWarper, 3),
    ("eta_cutoff", 0.3, lp.EtaLogitsWarper, 1),
    ("top_h", 0.8, lp.TopHLogitsWarper, 3),
]
SAMPLING = [Sampling(kw, (cls.__name__,), {kw: value}, _warped(cls, value), k) for kw, value, cls, k in _WARPERS] + [
    Sampling("repetition_penalty", ("RepetitionPenaltyLogitsProcessor",), dict(repetition_penalty=3.0),
             lambda: [lp.RepetitionPenaltyLogitsProcessor(3.0), lp.SuppressTokensLogitsProcessor(SUPPRESS)], 2),
]
WITHOUT = lambda: [lp.SuppressTokensLogitsProcessor(SUPPRESS)]  # noqa: E731  (the same call without the option)


def _processed_probs(processors, ids, logits):
    for p in processors:
        logits = p(ids, logits)
    return logits.softmax(-1)


def exact(model, adapter, processors, steps=STEPS):
    """P(first ``steps`` tokens), by enumerating every continuation (one batched forward per step)."""
    dist = {(): 1.0}
    for _ in range(steps):
        prefixes = list(dist)
        tails = torch.tensor(prefixes, dtype=torch.long).reshape(len(prefixes), -1)
        ids = torch.cat([PROMPT.repeat(len(prefixes), 1), tails], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, adapter_names=[adapter] * len(prefixes)).logits[:, -1]
        probs = _processed_probs(processors, ids, logits)
        nxt = {}
        for prefix, row in zip(prefixes, probs):
            for t in row.nonzero()[:, 0].tolist():
                nxt[prefix + (t,)] = dist[prefix] * float(row[t])
        dist = nxt
    return dist


@pytest.fixture(scope="module")
def smodel():
    model = tiny_peft("llama", vocab=SVOCAB, adapters=("b", "d"), strength=1.5, seed=1)
    with torch.no_grad():  # sharper distributions (tiny random models give near-uniform ones): the truncation
        model.get_base_model().lm_head.weight.mul_(5.0)  # warpers then keep several tokens but not all
    return model


@pytest.mark.parametrize("case", SAMPLING, ids=lambda s: s.id)
def test_sampling_keeps_the_target_distribution(smodel, case):
    target = {a: exact(smodel, a, case.processors()) for a in ("b", "__base__")}
    without = exact(smodel, "b", WITHOUT())
    # Power: the option really changes the distribution (the samples below must tell the two apart).
    assert sum(abs(target["b"].get(c, 0.0) - p) for c, p in without.items()) > 0.15
    rows = ["b"] * SB + ["__base__"] * (SN - SB)
    torch.manual_seed(11)
    out = smodel.generate(input_ids=PROMPT.repeat(SN, 1), adapter_names=rows, do_sample=True, suppress_tokens=SUPPRESS,
                          max_new_tokens=STEPS, invisible_lora=True, num_draft_tokens=case.k, gate="always",
                          return_dict_in_generate=True, **case.kwargs)
    samples = [tuple(r) for r in out.sequences[:, PROMPT.shape[1]:].tolist()]
    lora, base = samples[:SB], samples[SB:]
    assert chi_square_p(lora, target["b"]) > 1e-3
    assert chi_square_p(base, target["__base__"]) > 1e-3
    assert chi_square_p(lora, without) < 1e-6  # the test has power: the option's effect is visible in the samples
    assert sum(out.stats.drafted) > sum(out.stats.accepted) > 0  # drafts were accepted and rejected


def test_sampling_processor_list_matches_generate(smodel):
    """The enumeration applies what generate() builds: the classes, in generate()'s order."""
    cls = type(smodel.get_base_model())
    for case in SAMPLING:
        order = []

        def record(inner, input_ids, logits_processor, **kw):
            order.extend(type(p).__name__ for p in logits_processor)
            return input_ids

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cls, "_sample", record)
            smodel.generate(input_ids=PROMPT, adapter_names=["b"], do_sample=True, suppress_tokens=SUPPRESS,
                            max_new_tokens=1, **case.kwargs)
        ours = [type(p).__name__ for p in case.processors()]
        assert [n for n in order if n != "TopKLogitsWarper" or case.id == "top_k"] == ours, case.id


@pytest.mark.parametrize("seed", range(4))
def test_length_processors_in_one_call_equal_one_call_per_row(seed):
    """process_scores applies the min-length processors (and the scores-only ones) to every row and
    position in one call each: the same scores as calling each processor on that row's own length,
    as standard decoding's step at that length does (random lengths straddling the minimums, EOS ids
    at either end of the vocabulary, a subclass with its own __call__ taking the per-length road)."""
    from hf_invisiblelora.decode.processors import process_scores

    class OwnCall(lp.MinNewTokensLengthLogitsProcessor):
        def __call__(self, input_ids, scores):
            return super().__call__(input_ids, scores) * 1.0

    g = torch.Generator().manual_seed(seed)
    b, q, v, prompt = 5, 3, 11, 4
    lengths = (prompt + torch.randint(0, 6, (b,), generator=g)).tolist()
    tokens = torch.randint(0, v, (b, max(lengths) + q), generator=g)
    logits = torch.randn(b, q, v, generator=g)
    eos = [0, v - 1]
    for processors in ([lp.MinNewTokensLengthLogitsProcessor(prompt, 3, eos)],
                       [lp.TemperatureLogitsWarper(0.7), lp.MinLengthLogitsProcessor(prompt + 4, eos),
                        lp.MinNewTokensLengthLogitsProcessor(prompt, 2, eos[1:]), lp.TopKLogitsWarper(4)],
                       [OwnCall(prompt, 3, eos), lp.TemperatureLogitsWarper(0.5)]):
        out = process_scores(LogitsProcessorList(processors), tokens, lengths, logits.clone())
        for r in range(b):
            for t in range(q):
                want = logits[r, t][None].clone()
                for p in processors:
                    want = p(tokens[r : r + 1, : lengths[r] + t], want)
                assert torch.equal(out[r, t], want[0]), (processors, r, t)
        assert any(torch.isinf(out[r, t, 0]) for r in range(b) for t in range(q))  # a minimum applied somewhere
