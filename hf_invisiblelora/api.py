"""``generate(model, ..., adapter_names=...)`` and the ``invisible_lora=True`` flag on PEFT models.

Transformers' generate() does the standard preparation (generation config merging and
validation, logits processors, stopping criteria, ``num_return_sequences`` expansion, special
tokens, position ids) and then hands over to our decoding loop through its ``custom_generate``
callable hook.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch
from peft import PeftModel, PeftModelForCausalLM
from peft.tuners.lora.model import _adapter_names_pre_forward_hook
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import tuning
from .decode.checks import (
    check_adapter_state,
    check_cache,
    check_call,
    check_compile,
    check_model,
    resolve_adapter_names,
)
from .decode.drafters import check_vocabulary, observe as observe_tokens, vocabulary as drafter_vocabulary
from .decode.low_precision import draft_dtypes as resolve_draft_dtypes
from .decode.policies import GeneratePolicy
from .decode.grammar import grammar_masks
from .decode.processors import ScoreHistory, reads_scores, split_criteria, step_outputs
from .decode.session import Session, lora_backend as choose_lora_backend, make_drafters
from .decode.stats import DecodingStats
from .lora.bank import get_bank
from .lora.saved_modules import saves_modules
from .lora.switch import bank_inexact
from .model.forward import backend_for, length_bucket, row_bucket, warmed
from .model.layout import prompt_positions
from .model.rotary import Recompute, length_dependent, recompute_slot
from .model.state import state_of
from .options import Options
from .model.walk import BASE, linears, submodules

logger = logging.getLogger("hf_invisiblelora")
OPTIONS = (*Options.names(), "generator")  # generate() keywords that only InvisibleLoRA reads
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer")
# generate() kwargs that send it to another decoding loop before any custom_generate callable runs.
_OTHER_LOOPS = {"custom_generate": "it runs its own decoding loop through custom_generate",
                "cache_implementation": "cache_implementation='paged' sends generate() to continuous batching"}


@dataclass
class InvisibleLoRAOutput(GenerateDecoderOnlyOutput):
    """``generate(..., return_dict_in_generate=True)`` output: ``sequences``, ``cache`` plus ``stats``."""

    stats: DecodingStats | None = None


@contextlib.contextmanager
def _no_collection():
    """Python's cyclic collector held off for one call. A call makes thousands of short-lived objects
    (its routes and per-layer records), which the collector would promote and so trigger full passes
    over the whole process (some 600k objects with a model and 14 adapters loaded: 0.3 s each, one
    every few calls, 45 ms a call on average on SmolLM2; docs/benchmarks.md). What the call leaves as
    garbage is a fixed amount per call (about 11k objects, not per token), collected after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# What a call leaves on the model (the adapter bank, derived copies, token counts, caches) is updated in
# place by later calls: made as plain tensors also when the caller runs in inference mode (whose tensors
# could not be updated outside it). Our passes enter inference mode themselves (forward.py).
@torch.inference_mode(False)
@_no_collection()
def generate(model, inputs=None, *, adapter_names=None, num_draft_tokens: int = 4, gate: str = "auto",
             lora_backend: str = "bank", generator=None, compile="auto", draft_vocab=None, draft_dtype="auto",
             prompt_lookup: bool = True, prepack="auto", **kwargs):
    """Lossless InvisibleLoRA decoding of a PEFT LoRA causal LM; same arguments and output as ``model.generate``.

    adapter_names: one adapter per row (``"__base__"`` = no adapter); default: the active adapter.
    num_draft_tokens: the most tokens the base model drafts per cycle (K).
    gate: "auto" (draft when it can pay), "always" (draft K every cycle), "never" (no drafting:
        plain multi-LoRA decoding on the same engine: the optimized multi-LoRA baseline).
    lora_backend: "bank" (batched kernels over all adapters, default) or "peft" (PEFT's own
        per-adapter loop, the reference).
    generator: a ``torch.Generator`` for sampling (default: torch's global RNG).
    compile: "auto" (CUDA graphs on CUDA; on the CPU, where compiling costs minutes, the compiled
        passes of buckets ``warm_up`` built and measured faster than eager ones, eager otherwise), True
        (torch.compile on the CPU, CUDA graphs on CUDA) or False. Compiled passes have fixed shapes
        (rows, cache length, distinct adapters and their largest rank padded to buckets) and are
        kept on the model for later calls; the first call of a bucket pays the compilation (logged
        at INFO), or ``warm_up`` ahead of it. ``state_of(model).clear()`` drops them.
    draft_vocab: the drafter's head restricted to this many of the most frequent tokens seen in the
        model's prompts and outputs (plus the prompts' tokens), or to a list of token ids (drafters.py).
    draft_dtype: the drafter's linear layers in this dtype: torch.bfloat16 / torch.float16, or
        weight-only torch.int8 / torch.int4 (the CPU; low_precision.py); or a tuple of choices (None:
        full precision), among which the gate picks per cycle by measured cost and acceptance; "auto"
        (the default): for eager passes on the CPU, the full model and the low-precision copies
        measured faster on this CPU (tuning.py), where they fit in half the memory available; else
        None. Both options make draft passes cheaper where the kernels are fast, and keep the output
        exact.
    prompt_lookup: also draft by prompt lookup (prompt_lookup.PromptLookupDrafter: what followed an earlier
        occurrence of a row's last tokens in its prompt and output; no model pass), among the
        drafters the gate picks from (default True).
    prepack: the eager passes' float32 linear layers on the CPU run on copies of their weights
        prepacked for oneDNN or MKL (the weights' size again in memory; prepack.py): "auto" (each layer
        in the format and from the token count where its copy was measured faster on this CPU,
        tuning.py; where the copies fit in half the memory available), True or False.
    With ``return_dict_in_generate=True`` the output has ``.stats`` (DecodingStats); the last
    call's stats are also at ``state_of(model).stats``. Calls on one model run one at a time.
    A ``cache=`` (``past_key_values=``) DynamicCache is extended in place, as standard decoding
    extends it; one that an earlier call returned, with input_ids that call's sequences plus new
    tokens (a chat's next turn), is continued: only the tokens it does not hold are prefilled
    (checks.check_cache lists the caches refused).
    """
    options = Options(num_draft_tokens=num_draft_tokens, gate=gate, lora_backend=lora_backend, compile=compile,
                      draft_vocab=draft_vocab, draft_dtype=draft_dtype, prompt_lookup=prompt_lookup, prepack=prepack)
    check_model(model)
    # compile=True, or "auto" where warm_up chose compiled passes: those passes' drafter ("auto").
    chosen = compile == "auto" and any(b.chosen for b in state_of(model).buckets.values())
    draft_dtypes = resolve_draft_dtypes(draft_dtype, model, compiled=compile is True or chosen)
    inner = model.get_base_model()
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("invisible_lora needs input_ids (inputs_embeds are not supported).")
    for name in _ASSISTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"invisible_lora is speculative decoding already; it cannot be combined with {name}.")
    if kwargs.get("custom_generate") is not None or kwargs.get("cache_implementation") == "paged":
        why = _OTHER_LOOPS["custom_generate" if kwargs.get("custom_generate") is not None else "cache_implementation"]
        raise ValueError(f"invisible_lora cannot be combined with that: {why}. Use plain generate().")
    names = resolve_adapter_names(model, adapter_names, input_ids.shape[0])
    mixed = adapter_names is not None  # stock PEFT takes its mixed-batch path only when given adapter_names
    check_adapter_state(model, names, mixed)
    if isinstance(draft_vocab, (list, tuple, torch.Tensor)):
        draft_vocab = check_vocabulary(draft_vocab, inner)
    if lora_backend == "bank" and compile is True and (why := bank_inexact(model, set(names) - {BASE})):
        raise ValueError(f"compile=True needs the adapter bank, which cannot compute these adapters as PEFT does "
                         f"({why}); use compile=False, or cast the adapters to one dtype.")
    lora_backend = choose_lora_backend(model, names, lora_backend)
    compile_backend = backend_for(compile, model.device, model.dtype, lora_backend)
    # Compiled passes follow neither RoPE that depends on the length nor modules_to_save (checks.check_compile).
    modules = submodules(inner)  # the call's one walk of the model as it is now
    eager = any(length_dependent(m) for m in modules) or saves_modules(modules)
    if compile == "auto" and eager:
        compile_backend = None
    check_compile(compile_backend, modules)
    # "auto" on the CPU: the compiled passes of a bucket warm_up chose, never a compilation.
    warm_only = compile == "auto" and compile_backend is None and not eager and lora_backend == "bank" \
        and model.device.type == "cpu"
    streamer = kwargs.pop("streamer", None)
    tokenizer = kwargs.pop("tokenizer", None)
    inner.generation_config = model.generation_config  # as PEFT's own generate does
    _move_stop_strings(inner, kwargs, tokenizer)
    stats = DecodingStats(names, num_draft_tokens)
    state = state_of(model)

    call = Call(model, state, names, mixed, stats, streamer, options, lora_backend, compile_backend, warm_only,
                generator, draft_vocab, draft_dtypes, modules)
    with state.hold():
        out = inner.generate(input_ids, custom_generate=functools.partial(decode, call), **kwargs)
        state.stats = stats
    return out


@dataclass
class Call:
    """One generate() call's settings, checked (``generate``), for ``decode``."""

    model: object  # the PEFT model
    state: object  # its ModelState
    names: list  # each row's adapter (before num_return_sequences)
    mixed: bool  # adapter_names given: PEFT's mixed-batch path
    stats: DecodingStats
    streamer: object
    options: Options  # as given; what they resolve to on this model and call follows
    lora_backend: str
    compile_backend: str | None
    warm_only: bool  # compile="auto" on the CPU: a warmed-up bucket's compiled passes, never a compilation
    generator: object
    draft_vocab: object  # checked token ids, or a number of tokens
    draft_dtypes: tuple
    modules: list  # the base model's modules, walked once for the call (walk.submodules)


def decode(call: Call, inner, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """The decoding of one generate() call (``call``), as Transformers' ``custom_generate`` hook calls
    it after generate()'s preparation (processors and criteria built, ``input_ids`` expanded for
    num_return_sequences, the cache created): prefill, cycles until every row is done, then
    generate()'s output."""
    model, state, names, stats, streamer = call.model, call.state, call.names, call.stats, call.streamer
    options, draft_vocab, draft_dtypes = call.options, call.draft_vocab, call.draft_dtypes
    num_draft_tokens = options.num_draft_tokens
    mask, cache = model_kwargs.get("attention_mask"), model_kwargs.get("cache")
    given = cache if getattr(cache, "_is_user_defined", False) else None  # the caller's: extended in place
    check_cache(given, input_ids, mask, generation_config, inner)  # first: it explains input_ids of another length
    check_call(generation_config, logits_processor, model_kwargs, input_ids, streamer)
    b, prompt_len = input_ids.shape
    logits_processor = grammar_masks(logits_processor, prompt_len)
    rows = _expand(names, b)
    stats.adapter_names = rows
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = prompt_positions(mask, input_ids)
    stopping = split_criteria(stopping_criteria)
    pad = generation_config._pad_token_tensor
    if stopping.max_length is None:
        raise ValueError("invisible_lora needs a bound on the length: the stopping criteria hold no "
                         "MaxLengthCriteria (a passed subclass of it with its own code does not say how long "
                         "rows can get). Pass max_new_tokens or max_length.")
    if stopping.pads and pad is None:
        raise ValueError("A stopping criterion has an eos_token_id, so standard decoding pads the rows it stops, "
                         "but no pad_token_id (or eos_token_id) is set: pass pad_token_id=...")
    max_new = max(1, stopping.max_length - prompt_len)  # standard decoding checks the criteria after a token
    width = prompt_len + max_new + num_draft_tokens + 1
    if streamer is not None:
        streamer.put(input_ids.cpu())
    vocab_size = inner.config.get_text_config(decoder=True).vocab_size
    vocab = draft_vocab if draft_vocab is None or not isinstance(draft_vocab, int) else \
        drafter_vocabulary(state, draft_vocab, input_ids, vocab_size)
    drafters = make_drafters(model, state, draft_dtypes, vocab, size=draft_vocab if isinstance(draft_vocab, int) else None,
                             prompt_lookup=options.prompt_lookup, drafting=options.gate != "never")
    length = None
    if call.warm_only and state.buckets:  # a bucket warm_up chose, whose passes this call can take
        length = warmed(state.buckets, get_bank(model, adapters=()), input_ids.device, inner.dtype, b, width, rows,
                        range(1, num_draft_tokens + 2), options.gate != "never", [d.key for d in drafters if d.passes])
    backend = "inductor" if length else call.compile_backend
    pad_id = int(pad) if pad is not None else 0
    eos = stopping.eos
    slot = recompute_slot(inner, prompt_len)
    returned = generation_config.return_dict_in_generate
    want_scores, want_logits = returned and generation_config.output_scores, returned and generation_config.output_logits
    # Standard decoding hands the criteria its scores tuple when it returns scores.
    history = ScoreHistory(max_new, b, vocab_size, prompt_len, input_ids.device) \
        if want_scores and reads_scores(stopping.criteria) else None
    session = Session(
        model, state, GeneratePolicy(logits_processor, bool(generation_config.do_sample), call.generator),
        capacity=b, width=width, mixed=call.mixed, lora_backend=call.lora_backend, gate=options.gate,
        num_draft_tokens=num_draft_tokens, drafters=drafters, compile_backend=backend, length=length,
        prepack=options.prepack, span=b, pad_id=pad_id, eos=None if eos is None else eos.to(input_ids.device),
        criteria=stopping.criteria, freeze=stopping.pads, time_limits=stopping.time_limits,
        recompute=None if slot is None else Recompute(slot, b), scores=history,
        keep_prefill=want_scores or want_logits, modules=call.modules,
    )
    fwd = session.fwd
    past = given.get_seq_length() if given is not None else 0
    if past:  # a continued cache: its keys and values at their slots, the prefill starts after them
        fwd.cache.load(given, b)
    with session.installed() as decoder:
        committed = decoder.admit(list(range(b)), input_ids, mask, positions, [max_new] * b, rows, cached=past)
        while True:
            if streamer is not None and committed[0]:
                end = prompt_len + decoder.rows[0].gen
                streamer.put(decoder.batch.tokens[0, end - committed[0] : end].cpu())
            if not decoder.batch.active:
                break
            committed = decoder.cycle()
        new = decoder.output_length()
        sequences = decoder.sequences(list(range(b)), prompt_len + new, pad_id)
        observe_tokens(state, sequences, vocab_size)  # the draft vocabulary follows what is seen
        decoder.fill_stats(stats, new)
        if streamer is not None:
            streamer.end()
        if not returned and given is None:
            session.rotary.finish(prompt_len, new)
            return sequences
        scores = logits = None
        fed = want_scores or want_logits or _recomputes(decoder.recompute, prompt_len, new)
        if fed:  # every slot the returned cache holds is fed again, as standard decoding fed it
            raw = _step_logits(fwd, decoder, sequences, prompt_len, new, keep=want_scores or want_logits)
            if raw is not None:
                scores, logits = step_outputs(logits_processor, sequences, prompt_len, raw, want_scores)
                logits = logits if want_logits else None
        cache = _returned_cache(fwd, decoder.batch, sequences, inner.config, copy=backend is not None, fed=fed,
                                into=given)
        session.rotary.finish(prompt_len, new)  # after the passes above: the rotary modules as standard decoding leaves them
    if not returned:
        return sequences
    return InvisibleLoRAOutput(sequences=sequences, scores=scores, logits=logits, cache=cache, stats=stats)


def _recomputes(recompute, prompt_len: int, new: int) -> bool:
    """Whether Phi-3's cache recompute (rotary.Recompute) touches the returned cache: standard decoding
    recomputed it within the output, or a row's keys were recomputed during decoding."""
    return recompute is not None and (recompute.slot < prompt_len + new - 1 or any(recompute.done))


def _step_logits(fwd, decoder, sequences, prompt_len: int, new: int, keep: bool = True) -> torch.Tensor | None:
    """[new, B, V] float32: the raw logits standard decoding's step s computed for every row, as
    ``output_logits`` returns them (and ``output_scores`` processes them), the rows that finished
    fed the pad token after their end as standard decoding feeds them.

    Step 0 is the prefill's (kept by the Decoder). Steps 1 .. new-1 come from one LoRA-on pass over
    the output, teacher-forced: slots P .. P+new-2 (the tokens standard decoding's later steps fed),
    each row with its adapter, also writing every key/value the returned cache holds. Why this and
    not the verify passes' logits kept during decoding (which would save this pass): decoding never
    computes the finished rows' pad continuation, which standard decoding scores at every step, so a
    pass over those tails is needed anyway; the processors would have to run again for those rows
    at the whole batch's lengths; and keeping the logits of every committed position costs a
    copy per cycle (and B x new x V floats through decoding) in calls that may not want them. The
    pass costs about a prefill of B x (new-1) tokens, paid only when scores or logits are asked for,
    and it replaces the returned cache's own tail pass.

    Phi-3's one-time recompute of the cache at slot R (rotary.recompute_slot) is followed: queries
    before R see the keys as first computed (the prompt's are computed again if a row's were
    recomputed during decoding), then every row's slots [0, R) are recomputed as standard
    decoding's recompute pass computed them, and the queries from R on see those. (Also run with
    ``keep=False``, returning None, for the returned cache alone when that recompute touches it.)
    """
    b = sequences.shape[0]
    first = decoder.prefill_logits
    out = None
    if keep:
        out = first.new_empty(new, b, first.shape[-1])
        out[0] = first
    end = prompt_len + new - 1  # standard decoding never feeds the last token
    rows = torch.arange(b, device=sequences.device)
    at = lambda slot: torch.full((b,), slot, dtype=torch.long, device=sequences.device)  # noqa: E731
    recompute = decoder.recompute
    cut = recompute.slot if recompute is not None and prompt_len <= recompute.slot < end else None
    if recompute is not None and any(recompute.done[:b]):  # those rows' prompt keys were recomputed
        fwd(sequences[:, :prompt_len], at(0), prompt_len, keep=1, prefix=prompt_len, rows=rows)
    for a, z in ((prompt_len, end),) if cut is None else ((prompt_len, cut), (cut, end)):
        if a == cut:  # standard decoding's recompute pass (as Recompute.before_verify runs it)
            fwd(sequences[:, :cut], at(0), cut, keep=1, prefix=cut + 1, rows=rows)
        if z > a:
            logits = fwd(sequences[:, a:z], at(a), z, keep=z - a if keep else 1, rows=rows)
            if keep:  # slot j predicts step j + 1 - P
                out[a - prompt_len + 1 : z - prompt_len + 1] = logits.transpose(0, 1)
    return out


def _returned_cache(fwd, batch, sequences, config, copy: bool, fed: bool = False, into=None):
    """The DynamicCache standard generate() returns: keys/values of every token but the last.

    Rows that finished early were fed their EOS and padding by standard decoding (one step per
    token of the longest row); one LoRA-on pass over those tail slots computes the same entries.
    ``fed``: ``_step_logits`` has already fed all of them. ``into``: the caller's cache= (empty, or
    holding a prefix: a continued call), extended in place with the rest and returned, as standard
    decoding extends it (also when the output is only the sequences).
    """
    b, length = sequences.shape
    end = length - 1  # standard decoding never feeds the last token
    first = batch.rows[0].plen + min(row.gen for row in batch.rows[:b]) - 1  # the earliest slot a row has not cached
    if first < end and not fed:
        start = torch.full((b,), first, dtype=torch.long, device=sequences.device)
        fwd(sequences[:, first:end], start, end, keep=1)
    return fwd.cache.to_dynamic(config, end, rows=b, copy=copy, into=into)


def _expand(names: list[str], rows: int) -> list[str]:
    per = rows // len(names)  # num_return_sequences
    return [n for n in names for _ in range(per)]


def _move_stop_strings(inner, kwargs, tokenizer) -> None:
    """Build the stop-string criterion here (generate() drops the tokenizer when handing over to a
    callable), from the stop strings generate() would take (its merge of the kwargs, the passed
    config and the model's), and only where generate() would keep it: a StopStringCriteria passed
    in ``stopping_criteria`` replaces the one the stop strings make."""
    config, _ = inner._prepare_generation_config(kwargs.get("generation_config"),
                                                 **{k: v for k, v in kwargs.items() if k != "generation_config"})
    if config.stop_strings is None:
        return
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate().")
    kwargs["stop_strings"] = None  # the last word in generate()'s merge
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    if not any(type(c) is StopStringCriteria for c in criteria):
        criteria.append(StopStringCriteria(tokenizer, config.stop_strings))
    kwargs["stopping_criteria"] = criteria


def warm_up(model, adapter_names, batch_size: int, max_length: int, num_draft_tokens: int = 4) -> float:
    """Compile ahead of serving (``compile=True``) every pass that calls of ``batch_size`` rows, up to
    ``max_length`` tokens per row (prompt + new tokens + drafts), with ``adapter_names`` can run:
    draft, plain and verify of 2 .. num_draft_tokens + 1 tokens per row, in their buckets (rows,
    cache length, distinct adapters, largest rank: the highest-rank of ``adapter_names`` are used).
    Later calls in those buckets compile nothing. On the CPU, the compiled passes are then timed
    against the eager ones (``compiled_pays``: once per machine, model shapes and bucket; tuning.py),
    and ``compile="auto"`` (the default) takes them, for calls of as many rows (the same row bucket),
    at most ``max_length`` tokens per row and adapters the built passes cover, only where they were
    faster; where they were not, the bucket is dropped, and a later process's warm_up compiles
    nothing. Returns the seconds it took (also logged)."""
    names = list(dict.fromkeys(adapter_names))
    bank = get_bank(model, adapters=())
    index = {a: i for i, a in enumerate(bank.adapter_names)}
    names.sort(key=lambda a: -bank.max_rank([index[a]]) if a in index else 0)
    rows = [names[i % len(names)] for i in range(batch_size)]
    if max_length - num_draft_tokens - 3 < 1:  # the longest prompt build() gives: max_length - (k + 2) - K - 1
        raise ValueError(f"max_length {max_length} leaves no room for a prompt: it counts the prompt, the new "
                         f"tokens and {num_draft_tokens + 1} draft slots.")
    state = state_of(model)
    at = (model.device, model.dtype, row_bucket(batch_size), length_bucket(max_length))  # the bucket's key
    t = time.perf_counter()
    built = []

    def build():
        # One call per draft count k: its first cycle drafts k and verifies k + 1 tokens; gate "never" the plain pass.
        for k in range(num_draft_tokens, -1, -1):
            new = k + 2
            _fixed_call(model, rows, max_length - new - num_draft_tokens - 1, new, "always" if k else "never",
                        num_draft_tokens, compile=True)
        built.append(state.buckets.get(at))
        return built[-1]

    if model.device.type != "cpu":  # CUDA graphs: what compile="auto" takes there anyway
        chosen = build() is not None
    else:
        shapes = Counter(f"{m.out_features}x{m.in_features}" for m in linears(model))
        key = {"model": [type(model.get_base_model()).__name__, sorted(shapes.items())], "dtype": str(model.dtype),
               "rows": at[2], "length": at[3], "adapters": len(set(rows)),
               "rank": bank.max_rank([index[a] for a in set(rows) if a in index]), "k": num_draft_tokens}
        pays = tuning.tuned("compiled_passes", key,
                            lambda: compiled_pays(model, build(), rows, max_length, num_draft_tokens))["compiled"]
        bucket = (built[0] if built else build()) if pays else None  # a verdict from the machine's file: built now
        chosen = bucket is not None
        if chosen:
            bucket.chosen = True
        else:  # eager passes are faster here: keep no compiled passes of this bucket
            state.buckets.pop(at, None)
    seconds = time.perf_counter() - t
    logger.info("hf_invisiblelora: warmed up %d rows x %d tokens, %d adapters, in %.1f s: compile=\"auto\" takes %s",
                batch_size, max_length, len(set(rows)), seconds, "the compiled passes" if chosen else "eager passes")
    return seconds


def compiled_pays(model, bucket, rows, max_length: int, num_draft_tokens: int) -> dict:
    """{"compiled": whether calls on ``bucket``'s compiled passes (warm_up built them) take at most
    tuning.MARGIN of the time of the same calls on eager passes, "ms": the two}: ``rows`` with a
    prompt of up to 32 tokens and up to 16 new tokens (the compiled passes attend over the whole
    bucket, as the calls they serve do), once with plain steps (gate "never") and once drafting
    every cycle (gate "always"), each way as compile="auto" would run it (its drafters included),
    interleaved, the fastest of 3 (tuning.fastest)."""
    if bucket is None:
        return {"compiled": False, "ms": None}
    new = max(1, min(16, max_length - num_draft_tokens - 2))
    prompt = max(1, min(32, max_length - new - num_draft_tokens - 1))

    def call(compile, gate):
        return lambda: _fixed_call(model, rows, prompt, new, gate, num_draft_tokens, compile)

    bucket.chosen = True  # for the timed calls with compile="auto"; warm_up sets it by the verdict
    try:
        times = tuning.fastest({f"{way}:{gate}": call("auto" if way == "compiled" else False, gate)
                                for way in ("compiled", "eager") for gate in ("never", "always")}, repeats=3)
    finally:
        bucket.chosen = False
    total = {way: times[f"{way}:never"] + times[f"{way}:always"] for way in ("compiled", "eager")}
    return {"compiled": tuning.pick(total, "eager") == "compiled", "ms": {w: round(v * 1e3, 1) for w, v in total.items()}}


def _fixed_call(model, rows, prompt: int, new: int, gate: str, num_draft_tokens: int, compile):
    """A greedy call of ``rows`` (one adapter each) over a prompt of ``prompt`` ones, making exactly
    ``new`` tokens: warm_up's builds and compiled_pays's timings."""
    ids = torch.ones(len(rows), prompt, dtype=torch.long, device=model.device)
    return generate(model, ids, attention_mask=torch.ones_like(ids), adapter_names=rows, max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, gate=gate, num_draft_tokens=num_draft_tokens, compile=compile)


def install() -> None:
    """Make ``generate()`` of PEFT models accept ``invisible_lora=True`` (idempotent).

    Both classes: ``get_peft_model`` without ``task_type="CAUSAL_LM"`` gives a plain PeftModel.
    """
    for cls in (PeftModel, PeftModelForCausalLM):
        stock = cls.__dict__["generate"]
        if not getattr(stock, "_invisible_lora", False):
            cls.generate = _with_flag(stock)


def _with_flag(stock):
    @functools.wraps(stock)
    def generate_(self, *args, invisible_lora: bool = False, **kwargs):
        if invisible_lora:
            return generate(self, *args, **kwargs)
        ours = [o for o in OPTIONS if o in kwargs]
        if ours:
            raise ValueError(f"{ours} only apply with invisible_lora=True.")
        try:
            return stock(self, *args, **kwargs)
        except Exception:
            _drop_leaked_peft_hooks(self)
            raise

    generate_._invisible_lora = True
    return generate_


def _drop_leaked_peft_hooks(model) -> None:
    """PEFT installs its ``adapter_names`` pre-hooks without try/finally: after an exception
    (e.g. its own length check) they stay and break every later call. Remove them."""
    for m in model.modules():
        for hid, hook in list(m._forward_pre_hooks.items()):
            if isinstance(hook, functools.partial) and hook.func is _adapter_names_pre_forward_hook:
                del m._forward_pre_hooks[hid]
                m._forward_pre_hooks_with_kwargs.pop(hid, None)
