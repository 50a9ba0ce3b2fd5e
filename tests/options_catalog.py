"""How a user reaches each Transformers logits processor / stopping criterion in a decoder-only causal LM.

``enumerate_classes()`` lists every ``LogitsProcessor`` and ``StoppingCriteria`` subclass that
``transformers.generation`` defines or re-exports (warpers are ``LogitsProcessor`` subclasses too).
``CATALOG`` classifies each one; ``tests/test_generation_options.py`` fails while a class is
unclassified (a new Transformers version) and checks every "generate" entry: its kwargs really make
generate() build the class, and InvisibleLoRA decodes with it like standard decoding (or refuses it).

Kinds:
    generate  reached through ``generate()`` keyword arguments (``kwargs``); for a warper these
              include ``do_sample=True``.
    direct    not built by generate() for a causal LM, but generic code: a user can pass it in
              ``logits_processor=LogitsProcessorList([...])`` / ``stopping_criteria=...``, so the
              sweep does that (``detail`` says how).
    base      the abstract base class: user subclasses are the "custom" tests.
    n/a       does not apply to decoder-only text generation (``detail`` says why).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

from transformers.generation import logits_process, stopping_criteria


@dataclass(frozen=True)
class Entry:
    kind: str  # "generate" | "direct" | "base" | "n/a"
    detail: str
    kwargs: Callable[[], dict] | None = field(default=None, compare=False)  # "generate": kwargs that build it


def _tokenizer():
    from tiny import tiny_tokenizer

    return tiny_tokenizer()


def _watermark(**kw):
    from transformers import WatermarkingConfig

    return WatermarkingConfig(**kw)


def _synthid():
    from transformers import SynthIDTextWatermarkingConfig

    return SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340], ngram_len=3)


def _prefix_fn(batch_id, sent):
    return list(range(2, 64))


CATALOG: dict[str, Entry] = {
    # ---------------------------------------------------------------- logits processors
    "MinLengthLogitsProcessor": Entry(
        "generate", "min_length=N (with an EOS id): EOS banned while input_ids.shape[-1] (prompt included) < N",
        lambda: dict(min_length=8, eos_token_id=1)),
    "MinNewTokensLengthLogitsProcessor": Entry(
        "generate", "min_new_tokens=N (with an EOS id): EOS banned for the first N new tokens",
        lambda: dict(min_new_tokens=2, eos_token_id=1)),
    "RepetitionPenaltyLogitsProcessor": Entry(
        "generate", "repetition_penalty=p != 1 (prompt_ignore_length = each row's left padding, from the mask)",
        lambda: dict(repetition_penalty=1.3)),
    "EncoderRepetitionPenaltyLogitsProcessor": Entry(
        "generate", "encoder_repetition_penalty=p != 1: applies to decoder-only too (encoder_input_ids = the "
        "prompt input_ids, pads included); holds a per-row [B, P] tensor",
        lambda: dict(encoder_repetition_penalty=1.5)),
    "NoRepeatNGramLogitsProcessor": Entry(
        "generate", "no_repeat_ngram_size=n > 0 (n-grams of the whole row, prompt and pads included)",
        lambda: dict(no_repeat_ngram_size=2)),
    "EncoderNoRepeatNGramLogitsProcessor": Entry(
        "generate", "encoder_no_repeat_ngram_size=n > 0: applies to decoder-only too (the prompt's n-grams, "
        "kept per batch row and indexed by row // (rows / B))",
        lambda: dict(encoder_no_repeat_ngram_size=2)),
    "SequenceBiasLogitsProcessor": Entry(
        "generate", "sequence_bias=[[[ids...], bias], ...]", lambda: dict(sequence_bias=[[[5], -2.0], [[3, 4], 1.0]])),
    "NoBadWordsLogitsProcessor": Entry(
        "generate", "bad_words_ids=[[ids...], ...] (single tokens and sequences)",
        lambda: dict(bad_words_ids=[[5], [3, 4]])),
    "PrefixConstrainedLogitsProcessor": Entry(
        "generate", "prefix_allowed_tokens_fn=f(batch_id, input_ids_row) -> allowed ids; batch_id = row // "
        "max(num_beams, num_return_sequences)", lambda: dict(prefix_allowed_tokens_fn=_prefix_fn)),
    "ForcedBOSTokenLogitsProcessor": Entry(
        "generate", "forced_bos_token_id=t: forces t when input_ids.shape[-1] == 1 (decoder-only: prompts of width 1)",
        lambda: dict(forced_bos_token_id=3)),
    "ForcedEOSTokenLogitsProcessor": Entry(
        "generate", "forced_eos_token_id=t: forces t at input_ids.shape[-1] == max_length - 1 (the last token)",
        lambda: dict(forced_eos_token_id=3)),
    "InfNanRemoveLogitsProcessor": Entry(
        "generate", "remove_invalid_values=True (nan -> 0, +-inf -> finfo max/min)",
        lambda: dict(remove_invalid_values=True)),
    "ExponentialDecayLengthPenalty": Entry(
        "generate", "exponential_decay_length_penalty=(start, factor) (with an EOS id)",
        lambda: dict(exponential_decay_length_penalty=(2, 1.5), eos_token_id=1)),
    "LogitNormalization": Entry(
        "generate", "renormalize_logits=True (log_softmax, last): leaves the argmax and the sampling "
        "distribution unchanged",
        lambda: dict(renormalize_logits=True)),
    "SuppressTokensAtBeginLogitsProcessor": Entry(
        "generate", "begin_suppress_tokens=[...]: banned when input_ids.shape[-1] == the prompt width (the first "
        "new token)",
        lambda: dict(begin_suppress_tokens=[3])),
    "SuppressTokensLogitsProcessor": Entry(
        "generate", "suppress_tokens=[...]", lambda: dict(suppress_tokens=[3])),
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": Entry(
        "generate", "guidance_scale=g != 1 (optionally negative_prompt_ids): a second, unconditional model pass "
        "per step through the same model, with its own cache; stateful (one call per generated token)",
        lambda: dict(guidance_scale=1.5)),
    "WatermarkLogitsProcessor": Entry(
        "generate", "watermarking_config=WatermarkingConfig(...) (green list seeded from each row's last tokens)",
        lambda: dict(watermarking_config=_watermark())),
    "SynthIDTextWatermarkLogitsProcessor": Entry(
        "generate", "watermarking_config=SynthIDTextWatermarkingConfig(keys=..., ngram_len=...): stateful "
        "(per-row context and history, advanced once per call)", lambda: dict(watermarking_config=_synthid())),
    "TemperatureLogitsWarper": Entry("generate", "do_sample=True, temperature=T != 1",
                                     lambda: dict(do_sample=True, temperature=0.7)),
    "TopKLogitsWarper": Entry("generate", "do_sample=True, top_k=k (generation_config default 50)",
                              lambda: dict(do_sample=True, top_k=5)),
    "TopPLogitsWarper": Entry("generate", "do_sample=True, top_p=p < 1", lambda: dict(do_sample=True, top_p=0.5)),
    "TopHLogitsWarper": Entry("generate", "do_sample=True, top_h=h in (0, 1]", lambda: dict(do_sample=True, top_h=0.5)),
    "MinPLogitsWarper": Entry("generate", "do_sample=True, min_p=p", lambda: dict(do_sample=True, min_p=0.1)),
    "TypicalLogitsWarper": Entry("generate", "do_sample=True, typical_p=m < 1",
                                 lambda: dict(do_sample=True, typical_p=0.5)),
    "EpsilonLogitsWarper": Entry("generate", "do_sample=True, epsilon_cutoff=e in (0, 1)",
                                 lambda: dict(do_sample=True, epsilon_cutoff=0.01)),
    "EtaLogitsWarper": Entry("generate", "do_sample=True, eta_cutoff=e in (0, 1)",
                             lambda: dict(do_sample=True, eta_cutoff=0.01)),
    "AlternatingCodebooksLogitsProcessor": Entry(
        "direct", "Bark fine-model specific (built by Bark's own generate), but generic code (bans vocab ranges by "
        "the parity of input_ids.shape[-1] - input_start_len): passed in logits_processor= to a causal LM"),
    "BarkEosPrioritizerLogitsProcessor": Entry(
        "direct", "Bark specific (built by Bark's semantic generate), but generic code (forces EOS once "
        "P(EOS) > min_eos_p): passed in logits_processor= to a causal LM"),
    "ClassifierFreeGuidanceLogitsProcessor": Entry(
        "n/a", "MusicGen: scores must hold 2B rows (conditional + unconditional halves) for B input_ids rows, which "
        "only MusicGen's own generate produces; a causal LM's generate gives B rows (the processor raises)"),
    "DiaClassifierFreeGuidanceLogitsProcessor": Entry(
        "n/a", "Dia audio model: needs 2B score rows (conditional + unconditional) as MusicGen's CFG does"),
    "DiaEOSChannelFilterLogitsProcessor": Entry(
        "n/a", "Dia audio model: scores are [B * channels, V] audio-codebook rows; token ids above eos are audio "
        "specials (all banned); meaningless for a text LM"),
    "DiaEOSDelayPatternLogitsProcessor": Entry(
        "n/a", "Dia audio model: per-channel delay pattern over [B * channels] rows, stateful per Dia step"),
    "WhisperTimeStampLogitsProcessor": Entry(
        "n/a", "Whisper (encoder-decoder): needs a Whisper generation config (no_timestamps_token_id, timestamp "
        "vocabulary) and is built by WhisperForConditionalGeneration.generate"),
    "WhisperNoSpeechDetection": Entry(
        "n/a", "Whisper (encoder-decoder): runs the Whisper model on its audio input_features (set_model / "
        "set_inputs) during Whisper's long-form generate"),
    "LogitsProcessor": Entry("base", "abstract base class: user subclasses passed in logits_processor= (custom tests)"),
    # ---------------------------------------------------------------- stopping criteria
    "MaxLengthCriteria": Entry("generate", "max_length=N or max_new_tokens=n (always present)",
                               lambda: dict(max_length=12)),
    "MaxTimeCriteria": Entry("generate", "max_time=seconds", lambda: dict(max_time=30.0)),
    "StopStringCriteria": Entry("generate", "stop_strings=[...] with tokenizer=...",
                                lambda: dict(stop_strings=["the"], tokenizer=_tokenizer())),
    "EosTokenCriteria": Entry("generate", "eos_token_id=int or list (or the model's generation config)",
                              lambda: dict(eos_token_id=[1, 5])),
    "ConfidenceCriteria": Entry(
        "n/a", "assisted decoding only: generate() adds it to the *assistant* model's criteria "
        "(generation_config.is_assistant and assistant_confidence_threshold); it reads scores[-1] of a 1-row "
        "assistant batch. invisible_lora refuses assisted decoding"),
    "StoppingCriteria": Entry("base", "abstract base class: user subclasses passed in stopping_criteria= "
                              "(custom tests)"),
}


def enumerate_classes() -> dict[str, type]:
    """Every LogitsProcessor / StoppingCriteria subclass (base classes included) that transformers.generation
    defines in any submodule or re-exports, by name."""
    import transformers.generation as generation

    bases = (logits_process.LogitsProcessor, stopping_criteria.StoppingCriteria)
    found: dict[str, type] = {}

    def scan(namespace):
        for name in dir(namespace):
            try:
                obj = getattr(namespace, name)
            except Exception:  # a lazy export whose optional dependency is missing
                continue
            if inspect.isclass(obj) and issubclass(obj, bases):
                found[obj.__name__] = obj

    scan(generation)  # the lazy module's re-exports
    for info in pkgutil.walk_packages(generation.__path__, generation.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # optional dependencies (e.g. continuous batching kernels)
            continue
        scan(module)
    return found
