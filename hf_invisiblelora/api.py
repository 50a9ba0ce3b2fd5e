"""``generate(model, ..., adapter_names=...)`` and the ``invisible_lora=True`` flag on PEFT models.

Transformers' generate() does the standard preparation (generation config merging and
validation, logits processors, stopping criteria, ``num_return_sequences`` expansion, special
tokens) and then hands over to our decoding loop through its ``custom_generate`` callable hook.
"""

from __future__ import annotations

import functools

from peft import PeftModel, PeftModelForCausalLM
from peft.tuners.lora.model import _adapter_names_pre_forward_hook
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

from .adapters import BASE, SWITCHES, check_servable, resolve_adapter_names
from .compiled import CompiledForward, backend_for
from .decoding import EagerForward, InvisibleLoRAOutput, run
from .gate import Gate, check_gate, memory_of
from .stats import DecodingStats

OPTIONS = ("num_draft_tokens", "gate", "lora_backend", "generator", "compile")  # generate() keywords that only InvisibleLoRA reads
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer")
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def generate(model, inputs=None, *, adapter_names=None, num_draft_tokens: int = 4, gate: str = "auto",
             lora_backend: str = "bank", generator=None, compile="auto", **kwargs):
    """Lossless InvisibleLoRA decoding of a PEFT LoRA causal LM; same arguments and output as ``model.generate``.

    adapter_names: one adapter per row (``"__base__"`` = no adapter); default: the active adapter.
    num_draft_tokens: the most tokens the base model drafts per cycle (K).
    gate: "auto" (draft when it can pay), "always" (draft K every cycle), "never" (no drafting:
        plain multi-LoRA decoding on the same engine: the optimized multi-LoRA baseline).
    lora_backend: "bank" (batched kernels over all adapters, default) or "peft" (PEFT's own
        per-adapter loop, the reference).
    generator: a ``torch.Generator`` for sampling (default: torch's global RNG).
    compile: "auto" (CUDA graphs on CUDA; eager on the CPU, where compiling costs minutes), True
        (torch.compile on the CPU, CUDA graphs on CUDA) or False. Compiled passes have fixed shapes
        (rows and cache length padded to buckets) and are kept on the model for later calls; the
        first call of a bucket pays the compilation (logged at INFO). ``hf_invisiblelora.compiled.clear``
        drops them.
    With ``return_dict_in_generate=True`` the output has ``.stats`` (DecodingStats); the last
    call's stats are also at ``model.invisible_lora_stats``.
    """
    check_servable(model)
    check_gate(gate, num_draft_tokens)
    if lora_backend not in SWITCHES:
        raise ValueError(f"lora_backend must be one of {list(SWITCHES)}, got {lora_backend!r}.")
    compile_backend = backend_for(compile, model.device, model.dtype, lora_backend)
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("invisible_lora needs input_ids (inputs_embeds are not supported).")
    for name in _ASSISTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"invisible_lora is speculative decoding already; it cannot be combined with {name}.")
    names = resolve_adapter_names(model, adapter_names, input_ids.shape[0])
    streamer = kwargs.pop("streamer", None)
    tokenizer = kwargs.pop("tokenizer", None)
    _move_stop_strings(model, kwargs, tokenizer)
    stats = DecodingStats(names, num_draft_tokens)

    # generate() calls this after its preparation; ``input_ids`` are then expanded for num_return_sequences.
    def decode(inner, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        _check_config(generation_config)
        rows = _expand(names, input_ids.shape[0])
        stats.adapter_names = rows
        if streamer is not None:
            if input_ids.shape[0] != 1:
                raise ValueError("A streamer needs a batch of one row (as in standard generate).")
            streamer.put(input_ids.cpu())
        lora = SWITCHES[lora_backend](model, rows)

        def new_forward(pad, max_len):
            if compile_backend is None:
                return EagerForward(inner, lora, pad, max_len)
            return CompiledForward(inner, model, lora, pad, max_len, compile_backend, range(1, num_draft_tokens + 2))

        with lora.installed():
            sequences = run(
                input_ids, model_kwargs.get("attention_mask"), new_forward, logits_processor, stopping_criteria,
                generation_config, max_draft_tokens=num_draft_tokens,
                gate=Gate(gate, num_draft_tokens, rows, memory_of(model), BASE, variant=compile_backend or "eager"),
                streamer=streamer, generator=generator, stats=stats,
            )
        if generation_config.return_dict_in_generate:
            return InvisibleLoRAOutput(sequences=sequences, stats=stats)
        return sequences

    inner = model.get_base_model()
    inner.generation_config = model.generation_config  # as PEFT's own generate does
    out = inner.generate(input_ids, custom_generate=decode, **kwargs)
    model.invisible_lora_stats = stats
    return out


def _expand(names: list[str], rows: int) -> list[str]:
    per = rows // len(names)  # num_return_sequences
    return [n for n in names for _ in range(per)]


def _check_config(config) -> None:
    if config.num_beams > 1:
        raise ValueError("invisible_lora does not do beam search (num_beams > 1); use greedy or sampling.")
    if config.prompt_lookup_num_tokens is not None or getattr(config, "assistant_early_exit", None) is not None:
        raise ValueError("invisible_lora is speculative decoding already; it cannot be combined with assisted decoding.")
    asked = [o for o in _UNSUPPORTED_OUTPUTS if getattr(config, o, False)]
    if asked:
        raise ValueError(f"invisible_lora does not return {asked} yet; call generate without them.")


def _move_stop_strings(model, kwargs, tokenizer) -> None:
    """Build the stop-string criterion here: generate() drops the tokenizer when handing over to a callable."""
    config = kwargs.get("generation_config") or model.generation_config
    stop = kwargs.pop("stop_strings", None) or getattr(config, "stop_strings", None)
    if not stop:
        return
    if tokenizer is None:
        raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate().")
    if getattr(config, "stop_strings", None):
        config = config.__class__.from_dict(config.to_dict())
        config.stop_strings = None
        kwargs["generation_config"] = config
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    criteria.append(StopStringCriteria(tokenizer, stop))
    kwargs["stopping_criteria"] = criteria


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
