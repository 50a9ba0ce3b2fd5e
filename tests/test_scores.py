"""``output_scores`` / ``output_logits`` with invisible_lora=True return what standard PEFT decoding returns.

Standard decoding's ``_sample`` returns, with ``return_dict_in_generate=True``, one [B, V] float32
tensor per generated step for every row of the batch (rows that finished are fed the pad token and
scored too): ``scores`` after the logits processors, ``logits`` before them. Here they must be the
same tuples, shapes, dtype and values, exactly (float64 models, the float32 tensors compared with
no tolerance), for gate="always" with 1 and 3 drafts and gate="never", and the sequences must stay
standard decoding's. Each case checks that what it exercises shows in standard decoding's own output
(the processor changes its scores, rows finish at different steps, the criterion stops rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from test_generation_options import GREEDY_CASES, Ctx, StopOnScores
from transformers import Phi3Config, Phi3ForCausalLM, StoppingCriteriaList

import hf_invisiblelora  # noqa: F401  (makes generate() accept invisible_lora=True)
from tiny import PAD, prompts, tiny_peft, tiny_tokenizer, with_adapters

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]
LENGTHS = [5, 9, 3, 7, 9, 1, 6]
NEW = 12
CONFIGS = [("always", 1), ("always", 3), ("never", 1)]  # (gate, num_draft_tokens)
BOTH = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


@pytest.fixture(scope="module")
def model():
    return tiny_peft("llama", strength=0.6)


@pytest.fixture(scope="module")
def batch(model):
    ids, mask = prompts(LENGTHS)
    free = standard(model, ids, mask, ROWS, do_sample=False, max_new_tokens=NEW)
    return ids, mask, free[:, ids.shape[1]:]


def standard(model, ids, mask, rows, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, **kw)


def invisible(model, ids, mask, rows, gate, k, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, invisible_lora=True, gate=gate,
                          num_draft_tokens=k, **kw)


def assert_same(out, ref, prompt_len, where=""):
    """Same sequences; same scores and logits: both None or tuples of one [B, V] float32 tensor per step, equal."""
    assert torch.equal(out.sequences, ref.sequences), f"{where}: sequences differ from standard decoding"
    for name in ("scores", "logits"):
        got, want = getattr(out, name), getattr(ref, name)
        if want is None:
            assert got is None, f"{where}: {name} returned but standard decoding returns none"
            continue
        assert isinstance(got, tuple), f"{where}: {name} is {type(got).__name__}, not a tuple"
        assert len(got) == len(want) == ref.sequences.shape[1] - prompt_len, f"{where}: {name}: {len(got)} steps"
        for step, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, f"{where}: {name}[{step}] {a.dtype} {a.shape}"
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {name}[{step}]: {m}")


def processed(ref) -> bool:
    """The processors changed standard decoding's scores at some step."""
    return any(not torch.equal(s, l) for s, l in zip(ref.scores, ref.logits))


def ends(ref, prompt_len) -> list[int]:
    """Generated tokens of each row before its trailing padding (standard decoding pads the rows that finished)."""
    new = ref.sequences[:, prompt_len:]
    return [int((row != PAD).nonzero().max()) + 1 if (row != PAD).any() else 0 for row in new]


def finish_apart(ref, prompt_len) -> bool:
    """Rows finish at different steps, and some are scored (fed pad) after their end."""
    e = ends(ref, prompt_len)
    steps = ref.sequences.shape[1] - prompt_len
    return len(set(e)) > 1 and any(n < steps for n in e)


@dataclass
class Case:
    id: str
    kwargs: Callable[[torch.Tensor], dict]  # from the free run's generated tokens [B, NEW]
    power: Callable  # (standard output, prompt_len, free generated tokens) -> the case shows in standard's output
    outputs: dict = None  # which outputs (default: scores and logits)


def _t(x):
    return int(x)


def _eos(new):
    """Two tokens the rows produce early: as EOS ids they stop rows at different steps."""
    return [_t(new[0, 2]), _t(new[3, 1])]


def _stop_strings(new):
    tok = tiny_tokenizer()
    return dict(stop_strings=[tok.decode(new[2, 5:7].tolist()), tok.decode(new[1, 2:4].tolist())], tokenizer=tok)


CASES = [
    Case("greedy_mixed", lambda new: {}, lambda ref, p, new: len(set(ROWS)) > 1),
    Case("eos_ids_and_pad", lambda new: dict(eos_token_id=_eos(new), pad_token_id=PAD),
         lambda ref, p, new: finish_apart(ref, p)),
    Case("repetition_penalty", lambda new: dict(repetition_penalty=1.5), lambda ref, p, new: processed(ref)),
    Case("no_repeat_ngram_size", lambda new: dict(no_repeat_ngram_size=2), lambda ref, p, new: processed(ref)),
    Case("min_new_tokens", lambda new: dict(eos_token_id=_eos(new), min_new_tokens=5),
         lambda ref, p, new: processed(ref) and finish_apart(ref, p)),
    Case("suppress_tokens", lambda new: dict(suppress_tokens=[_t(new[0, 2]), _t(new[4, 1]), _t(new[5, 2])]),
         lambda ref, p, new: processed(ref)),
    Case("bad_words_ids", lambda new: dict(bad_words_ids=[[_t(new[0, 2])], [_t(new[3, 0]), _t(new[3, 1])]]),
         lambda ref, p, new: processed(ref)),
    Case("stop_strings", _stop_strings, lambda ref, p, new: finish_apart(ref, p)),
    # Standard decoding hands a criterion that reads scores the tuple of processed scores so far.
    Case("criterion_reads_scores",
         lambda new: dict(stopping_criteria=StoppingCriteriaList([StopOnScores([], threshold=0.1)]), repetition_penalty=1.3),
         lambda ref, p, new: finish_apart(ref, p) and processed(ref)),
    Case("scores_only", lambda new: dict(eos_token_id=_eos(new), repetition_penalty=1.5),
         lambda ref, p, new: ref.logits is None and finish_apart(ref, p), outputs=dict(output_scores=True)),
    Case("logits_only", lambda new: dict(eos_token_id=_eos(new), repetition_penalty=1.5),
         lambda ref, p, new: ref.scores is None and finish_apart(ref, p), outputs=dict(output_logits=True)),
    Case("criterion_reads_scores_logits_only",  # no output_scores: the criterion is handed None
         lambda new: dict(stopping_criteria=StoppingCriteriaList([StopOnScores([_t(new[0, 3]), _t(new[4, 5])])])),
         lambda ref, p, new: ref.scores is None and finish_apart(ref, p), outputs=dict(output_logits=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_scores_and_logits_as_standard(model, batch, case):
    ids, mask, new = batch
    p = ids.shape[1]

    def kw():  # built afresh per call (criteria may hold state)
        return dict(do_sample=False, max_new_tokens=NEW, return_dict_in_generate=True,
                    **(case.outputs or dict(output_scores=True, output_logits=True)), **case.kwargs(new))

    ref = standard(model, ids, mask, ROWS, **kw())
    assert case.power(ref, p, new), "no power: the case does not show in standard decoding's output"
    for gate, k in CONFIGS:
        out = invisible(model, ids, mask, ROWS, gate, k, **kw())
        assert_same(out, ref, p, f"gate={gate} k={k}")
        if case.id == "greedy_mixed" and gate == "always":  # drafts were rejected: verify positions went unused
            assert 0 < sum(out.stats.accepted) < sum(out.stats.drafted)


def test_criterion_reading_scores_is_served_and_stops_rows(model, batch):
    """The criterion stops rows only because it reads the scores (without output_scores it is handed None)."""
    ids, mask, new = batch
    crit = lambda: StoppingCriteriaList([StopOnScores([], threshold=0.1)])  # noqa: E731
    ref = standard(model, ids, mask, ROWS, do_sample=False, max_new_tokens=NEW, stopping_criteria=crit(),
                   return_dict_in_generate=True, output_scores=True)
    plain = standard(model, ids, mask, ROWS, do_sample=False, max_new_tokens=NEW, stopping_criteria=crit())
    assert not torch.equal(ref.sequences[:, : plain.shape[1]], plain) or ref.sequences.shape != plain.shape
    out = invisible(model, ids, mask, ROWS, "always", 3, do_sample=False, max_new_tokens=NEW, stopping_criteria=crit(),
                    return_dict_in_generate=True, output_scores=True)
    assert_same(out, ref, ids.shape[1], "gate=always k=3")


def test_num_return_sequences_sampling_top_k_1(model, batch):
    """num_return_sequences=2 with do_sample and top_k=1 (deterministic): standard decoding of the rows
    expanded by hand (PEFT's own generate cannot combine adapter_names with num_return_sequences), with EOS."""
    ids, mask, new = batch
    rows2 = [n for n in ROWS for _ in range(2)]
    kw = dict(do_sample=True, top_k=1, max_new_tokens=NEW, eos_token_id=_eos(new), **BOTH)
    ref = standard(model, ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), rows2, **kw)
    assert processed(ref) and finish_apart(ref, ids.shape[1])
    for gate, k in CONFIGS:
        out = invisible(model, ids, mask, ROWS, gate, k, num_return_sequences=2, **kw)
        assert_same(out, ref, ids.shape[1], f"gate={gate} k={k}")


def test_sampling_scores_where_the_tokens_agree(model, batch):
    """Real sampling: the outputs differ from standard decoding's, but wherever a row's tokens so far
    are the same, its scores and logits of that step are standard decoding's."""
    ids, mask, _ = batch
    p = ids.shape[1]
    kw = dict(do_sample=True, temperature=0.7, top_k=10, max_new_tokens=NEW, **BOTH)
    torch.manual_seed(3)
    ref = standard(model, ids, mask, ROWS, **kw)
    assert processed(ref)
    for gate, k in CONFIGS:
        torch.manual_seed(3)
        out = invisible(model, ids, mask, ROWS, gate, k, **kw)
        assert len(out.scores) == len(out.logits) == out.sequences.shape[1] - p
        compared = 0
        for r in range(len(ROWS)):
            for s in range(min(len(ref.scores), len(out.scores))):
                if not torch.equal(out.sequences[r, : p + s], ref.sequences[r, : p + s]):
                    break
                for name in ("scores", "logits"):
                    torch.testing.assert_close(getattr(out, name)[s][r], getattr(ref, name)[s][r], rtol=0, atol=0)
                compared += 1
        assert compared >= len(ROWS)  # every row's first step at least


def test_output_scores_without_return_dict(model, batch):
    """Without return_dict_in_generate standard decoding returns the sequences only (scores are not kept)."""
    ids, mask, _ = batch
    kw = dict(do_sample=False, max_new_tokens=NEW, output_scores=True, output_logits=True)
    out = invisible(model, ids, mask, ROWS, "always", 3, **kw)
    assert isinstance(out, torch.Tensor) and torch.equal(out, standard(model, ids, mask, ROWS, **kw))


def test_attentions_and_hidden_states_refused(model, batch):
    ids, mask, _ = batch
    for option in ("output_attentions", "output_hidden_states"):
        with pytest.raises(ValueError, match="does not return"):
            invisible(model, ids, mask, ROWS, "always", 1, max_new_tokens=4, return_dict_in_generate=True,
                      **{option: True})


def test_phi3_cache_recompute_crossed():
    """Phi-3 recomputes its whole cache once the sequence reaches original_max_position_embeddings + 1
    tokens (LongRoPE's long factors for every key): the returned logits follow it, for rows that
    finished before that slot too (standard decoding recomputes every row)."""
    head = 32 // 4
    rope = dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0 + 0.1 * i for i in range(head // 2)], long_factor=[3.0 + 0.5 * i for i in range(head // 2)])
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=64, max_position_embeddings=64, original_max_position_embeddings=12,
                        rope_parameters=rope, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, pad_token_id=PAD, eos_token_id=1)
    torch.manual_seed(1)
    model = with_adapters(Phi3ForCausalLM(config).double().eval(),
                          {"p": dict(r=4, target_modules=["qkv_proj", "o_proj"]),
                           "q": dict(r=8, target_modules=["gate_up_proj", "down_proj"])}, 0.6)
    ids, mask = prompts([5, 9, 3, 7])
    names = ["p", "q", "__base__", "p"]
    p = ids.shape[1]
    free = standard(model, ids, mask, names, do_sample=False, max_new_tokens=10)
    kw = dict(do_sample=False, max_new_tokens=10, eos_token_id=int(free[3, p + 1]), pad_token_id=PAD,
              repetition_penalty=1.3, **BOTH)
    ref = standard(model, ids, mask, names, **kw)
    assert finish_apart(ref, p) and min(ends(ref, p)) + p < 12 < ref.sequences.shape[1] - 1  # a row ends before the slot
    for gate, k in CONFIGS:
        out = invisible(model, ids, mask, names, gate, k, **kw)
        assert_same(out, ref, p, f"gate={gate} k={k}")
        for a, b in zip(out.cache.layers, ref.cache.layers):  # the returned cache too
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(a.values, b.values, rtol=1e-9, atol=1e-9)
    # The returned cache alone (no scores or logits asked for) follows the recompute too.
    out = invisible(model, ids, mask, names, "always", 3, **{**kw, "output_scores": False, "output_logits": False})
    assert out.scores is None and out.logits is None and torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.cache.layers, ref.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a.values, b.values, rtol=1e-9, atol=1e-9)
    # The recompute matters: with the switch point moved past the output, standard decoding's logits differ.
    model.base_model.model.config.rope_parameters["original_max_position_embeddings"] = 64
    moved = standard(model, ids, mask, names, **kw)
    assert any(not torch.equal(a, b) for a, b in zip(moved.logits, ref.logits))


# Every option of test_generation_options' greedy sweep (processors, warpers made deterministic, criteria,
# user processors reading the batch index, the length or the scores) with scores and logits returned;
# one drafting setting per option, in turn (the cases above run all three). The sweep itself checks that
# each option reaches its class and changes standard decoding's tokens. Left out: the options it refuses
# (test_sweep_refusals_still_refused) and watermark_selfhash, WatermarkLogitsProcessor as watermark_lefthash
# is, whose self-hashing scheme costs 20 s here.
REFUSED = ("guidance_scale", "guidance_scale_negative_prompt", "synthid_watermark")
SWEEP = [c for c in GREEDY_CASES if c.id not in REFUSED + ("watermark_selfhash",)]


@pytest.mark.parametrize("i", range(len(SWEEP)), ids=lambda i: SWEEP[i].id)
def test_option_sweep_scores_and_logits(model, i):
    case = SWEEP[i]
    gate, k = CONFIGS[i % len(CONFIGS)]
    ids, mask = case.inputs() if case.inputs else prompts(LENGTHS)
    ctx = Ctx(ids, mask, standard(model, ids, mask, ROWS, **case.common))

    def kw():
        return {**case.common, **case.kwargs(ctx), **BOTH}

    torch.manual_seed(0)
    ref = standard(model, ids, mask, ROWS, **kw())
    torch.manual_seed(0)
    out = invisible(model, ids, mask, ROWS, gate, k, **kw())
    assert_same(out, ref, ids.shape[1], f"{case.id} gate={gate} k={k}")


def test_sweep_refusals_still_refused(model):
    """The options the sweep refuses (classifier-free guidance, SynthID) are refused with scores asked for too."""
    ids, mask = prompts(LENGTHS)
    for case in GREEDY_CASES:
        if case.id in REFUSED:
            ctx = Ctx(ids, mask, ids)
            with pytest.raises(ValueError):
                invisible(model, ids, mask, ROWS, "always", 1, **{**case.common, **case.kwargs(ctx), **BOTH})
