"""The one validation step: everything InvisibleLoRA cannot serve is refused here, before anything
changes, with a ValueError naming the problem and what to do.

``check_model`` runs before generate()'s preparation, ``check_cache`` and ``check_call`` after it (on
the generation config, processors, model inputs and cache generate() built or was passed), all before
the model is touched.
"""

from __future__ import annotations

import inspect
from typing import Sequence

from peft import PeftModel
from peft.tuners.lora.layer import Embedding as LoraEmbedding, Linear as LoraLinear
from peft.tuners.lora.variants import DoraLinearVariant
from transformers.cache_utils import DynamicCache, DynamicLayer, get_layer_types_and_kwargs
from transformers.generation import logits_process as lp
from transformers.generation.configuration_utils import GenerationMode

from ..lora.saved_modules import saves_modules
from ..model.cache import ATTENTION_LAYERS
from ..model.layout import ATTENTION
from ..model.quantized import check_layer, check_weights
from ..model.rotary import length_dependent
from ..model.walk import BASE, all_modules, layer_adapters, lora_layers, named_lora_layers

# Returned per-step outputs not served: standard decoding's are the attention weights and hidden states of
# its one-token steps, per layer; the passes here run several tokens per row at different slots over a
# padded cache, so reproducing them would take a pass per step. (output_scores / output_logits are served:
# api._step_logits.)
_UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")
# Model inputs generate() hands over that decoding itself provides or that need no handling.
_MODEL_INPUTS = ("attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep")
# Architectures the sweep of Transformers' causal LMs found incompatible for reasons no config
# field shows (docs/support.md). The key is config.model_type.
UNSUPPORTED = {
    "doge": "its dynamic attention mask (a top-k over keys) gives a pass of several tokens other results "
            "than the same tokens one at a time, so drafts cannot be verified exactly",
    "dory": "its looped layers copy and extend the KV cache themselves",
    "git": "it keeps image tokens in its cache that input_ids do not show, and widens masks for them",
    "gemma4_assistant": "it is a drafter that attends over a target model's shared KV states",
    "gemma4_unified_assistant": "it is a drafter that attends over a target model's shared KV states",
    "musicgen": "its input rows are audio codebooks, several per sequence",
    "musicgen_melody": "its input rows are audio codebooks, several per sequence",
    "xlm": "its generation appends a mask token to every step's input",
}


def check_model(model) -> None:
    """The model and its adapters: PEFT LoRA on linear layers (plain or quantized: quantized.py) and
    embedding layers, DoRA on plain linear layers (bank.py), unmerged, in eval mode, on an
    architecture whose attention, positions and cache InvisibleLoRA can drive per row."""
    if not isinstance(model, PeftModel):
        raise ValueError(
            f"invisible_lora needs a PEFT model with LoRA adapters, got {type(model).__name__}. "
            "Wrap it with peft.get_peft_model(model, LoraConfig(...)) or PeftModel.from_pretrained(model, path)."
        )
    not_lora = {n: c.peft_type.value for n, c in model.peft_config.items() if c.peft_type.value != "LORA"}
    if not_lora:
        raise ValueError(f"invisible_lora serves LoRA adapters only; these are not LoRA: {not_lora}.")
    if BASE in model.peft_config:
        raise ValueError(f"An adapter is named {BASE!r}, PEFT's name for 'no adapter'; rename it.")
    if model.training:
        raise ValueError("invisible_lora decodes in inference mode: call model.eval() first (dropout must be off).")
    for name, cfg in model.peft_config.items():
        # modules_to_save are served, each row through its adapter's copy (saved_modules.py).
        if getattr(cfg, "trainable_token_indices", None):
            raise ValueError(
                f"Adapter {name!r} trains single token embeddings (trainable_token_indices), which invisible_lora "
                "does not serve per row. Serve it with plain generate(), or train whole modules (modules_to_save)."
            )
    layers = lora_layers(model)
    if not layers:
        raise ValueError("The PEFT model has no LoRA layers: nothing for invisible_lora to speed up.")
    for m in layers:
        if m.merged:
            raise ValueError(
                "Some adapters are merged into the base weights, so the base model cannot draft. "
                "Call model.unmerge_adapter() first."
            )
        if type(m) is not LoraEmbedding:  # embedding LoRA: PEFT's own term per row (bank.py)
            check_layer(m)
        variants = {a: type(v).__name__ for a, v in m.lora_variant.items()
                    if not (type(v) is DoraLinearVariant and type(m) is LoraLinear)}
        if variants:
            raise ValueError(f"Of the LoRA variants, invisible_lora serves DoRA on Linear layers "
                             f"(peft.tuners.lora.layer.Linear); found {variants} on {type(m).__name__} (aLoRA and "
                             "other variants, DoRA on embedding or convolution layers or on PEFT's quantized LoRA "
                             "layers, whose base was quantized before the adapter was added). Serve them with "
                             "plain generate().")
        if any(m.lora_bias.values()):
            raise ValueError("LoRA adapters with lora_bias=True are not supported. Serve them with plain generate().")
    check_weights(model)
    check_architecture(model.get_base_model())


def check_adapter_state(model, names: list[str], mixed: bool) -> None:
    """PEFT's per-layer state that its LoRA forward reads, where the call cannot follow it.

    Followed (not refused): a layer's ``disable_adapters`` (PEFT's ``disable_adapter()`` context and
    ``disable_adapter_layers()``: the layer computes its base alone, mixed batch or not), its
    ``scaling`` (``set_scale``) and weights. Refused: dropout in training mode anywhere (standard
    decoding would drop activations at random), and, for a call without ``adapter_names`` (each
    layer then sums its own active adapters), layers whose active adapters are not the model's.
    """
    if any(m.training for m in all_modules(model)):
        raise ValueError("Some modules of the model are in training mode (their dropout would be applied): call "
                         "model.eval() first.")
    if mixed:
        return
    active = set(names) - {BASE}
    odd = [name for name, m in named_lora_layers(model)
           if set(m.active_adapters) & set(layer_adapters(m)) != active & set(layer_adapters(m))]
    if odd:
        raise ValueError(f"LoRA layers {odd[:3]}{' ...' if len(odd) > 3 else ''} have other active adapters than the "
                         f"model's {sorted(active)}; pass adapter_names=[...] (or call model.set_adapter(...)).")


# Generation methods standard decoding runs on the model, which our loop does not call: a model
# class that defines its own (a user's subclass, remote code) decodes by its own rules.
_GENERATION_HOOKS = ("_sample", "_prefill", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation")


def check_architecture(inner) -> None:
    config = inner.config
    text = config.get_text_config(decoder=True)
    name = type(inner).__name__
    own = [(m, c.__module__) for m in _GENERATION_HOOKS
           for c in [next(c for c in type(inner).__mro__ if m in vars(c))]
           if not c.__module__.startswith("transformers.")]
    if own:
        raise ValueError(f"{name} defines its own {', '.join(m for m, _ in own)} (in {own[0][1]}), which standard "
                         "decoding calls at every step and invisible_lora's loop does not. Use plain generate().")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"invisible_lora serves decoder-only models; {name} is an encoder-decoder.")
    if config.model_type in UNSUPPORTED:
        raise ValueError(f"invisible_lora cannot serve {name}: {UNSUPPORTED[config.model_type]}. Use plain generate().")
    parameters = inspect.signature(inner.forward).parameters
    if "cache" not in parameters and "past_key_values" not in parameters:
        raise ValueError(f"{name} decodes without a KV cache (its forward takes none), which the drafter and the "
                         "verifier share. Use plain generate().")
    implementation = text._attn_implementation or "eager"
    if implementation not in ATTENTION:
        raise ValueError(
            f"invisible_lora builds per-row attention masks for attn_implementation 'sdpa' or 'eager'; this model "
            f"uses {implementation!r}. Load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
        )
    if "position_ids" not in parameters:
        raise ValueError(
            f"{name} computes token positions itself (its forward takes no position_ids; e.g. the ALiBi models "
            "Bloom and MPT), so rows at different lengths cannot share a pass. Serve it with plain generate()."
        )
    if getattr(text, "alibi", False):
        raise ValueError(f"{name} uses ALiBi position biases built from a 2D mask, which per-row passes cannot give it. "
                         "Serve it with plain generate().")
    try:
        kinds, _ = get_layer_types_and_kwargs(text)
    except Exception:  # configs without a per-layer description: plain attention layers
        kinds = ["full_attention"]
    other = sorted(set(kinds) - set(ATTENTION_LAYERS) - {"dummy"})
    if other:
        raise ValueError(
            f"{name} has layers of kind {other}, whose cache is not plain per-token keys and values (recurrent or "
            "linear-attention state cannot be rolled back past rejected drafts; indexed and compressed caches are "
            "not supported). Serve it with plain generate()."
        )


def check_compile(backend, modules) -> None:
    """``modules``: the base model's (the call's walk, walk.submodules)."""
    if backend is not None and any(length_dependent(m) for m in modules):
        raise ValueError("compile=True does not support rotary embeddings that depend on the sequence length "
                         "(dynamic NTK, LongRoPE); use compile=False.")
    if backend is not None and saves_modules(modules):
        raise ValueError("compile=True does not support adapters with modules_to_save (each pass picks every "
                         "row's copy of those modules on the host); use compile=False.")


def resolve_adapter_names(model: PeftModel, adapter_names: Sequence[str] | None, batch_size: int) -> list[str]:
    """Per-row adapter names, validated. ``None`` means the active adapter for every row."""
    loaded = list(model.peft_config)
    if adapter_names is None:
        active = model.active_adapters
        if len(active) != 1:
            raise ValueError(
                f"Several adapters are active at once ({active}); pass adapter_names=[...] to choose one per row."
            )
        return [active[0]] * batch_size
    if isinstance(adapter_names, str) or not isinstance(adapter_names, Sequence):
        raise ValueError(f"adapter_names must be a list of adapter names, one per row, got {adapter_names!r}.")
    if len(adapter_names) != batch_size:
        raise ValueError(
            f"adapter_names has {len(adapter_names)} entries but the batch has {batch_size} rows: give one "
            "adapter name per prompt (with pipeline(), pass batch_size=len(prompts) so one call sees them all)."
        )
    unknown = sorted({a for a in adapter_names if a != BASE and a not in loaded})
    if unknown:
        raise ValueError(f"Unknown adapter(s) {unknown}; loaded adapters: {loaded} (or {BASE!r} for none).")
    return list(adapter_names)


def _given(value) -> bool:
    # generate() passes some inputs as empty containers when there are none (mm_encoder_outputs={}).
    return value is not None and not (isinstance(value, (dict, list, tuple)) and not value)


def check_call(config, processors, model_kwargs, input_ids, streamer) -> None:
    """What generate() prepared: the decoding mode, the processors and the model inputs."""
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"invisible_lora decodes greedily or by sampling; these settings ask for {mode.value.replace('_', ' ')} "
            "(num_beams, penalty_alpha with top_k, dola_layers, constraints, ...). Drop them or use plain generate()."
        )
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise ValueError("invisible_lora does not do classifier-free guidance (guidance_scale): it needs a second "
                         "model pass per step. Use plain generate().")
    for p in processors:
        if isinstance(p, lp.UnbatchedClassifierFreeGuidanceLogitsProcessor):
            raise ValueError("invisible_lora does not do classifier-free guidance: it needs a second model pass per step.")
        if isinstance(p, lp.SynthIDTextWatermarkLogitsProcessor):
            # It keeps a running context that advances on every call: drafts would advance it too.
            raise ValueError("invisible_lora cannot apply the SynthID watermark (its processor keeps state across "
                             "steps, which speculative passes would advance); use plain generate().")
    asked = [o for o in _UNSUPPORTED_OUTPUTS if getattr(config, o, False)]
    if asked:
        raise ValueError(f"invisible_lora does not return {asked} (attention weights and hidden states of standard "
                         "decoding's one-token steps); call generate without them. output_scores and output_logits "
                         "are served.")
    extra = sorted(k for k, v in model_kwargs.items() if _given(v) and k not in _MODEL_INPUTS)
    if extra:
        raise ValueError(f"invisible_lora takes input_ids, attention_mask and position_ids; got {extra} too.")
    positions = model_kwargs.get("position_ids")
    if positions is not None and tuple(positions.shape) != tuple(input_ids.shape):
        raise ValueError(f"position_ids must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(positions.shape)} (multi-axis positions are not supported).")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("A streamer needs a batch of one row (as in standard generate).")


def check_cache(cache, input_ids, attention_mask, config, inner) -> None:
    """The caller's ``cache=`` (``past_key_values=``), which standard decoding extends in place: empty,
    or holding the keys and values of the first tokens of ``input_ids`` (an earlier call's returned
    cache, input_ids that call's sequences plus new tokens), which decoding then continues from.
    ``attention_mask`` and ``config``: as generate() prepared them (an all-ones mask is None then)."""
    if cache is None:
        return
    if not isinstance(cache, DynamicCache) or cache.offloading:
        kind = ("an offloaded " if isinstance(cache, DynamicCache) else "a ") + type(cache).__name__
        raise ValueError(f"invisible_lora decodes in a cache of its own and extends the cache= passed with the "
                         f"result, as standard decoding extends a DynamicCache; it cannot fill {kind} as standard "
                         "decoding does. Pass a DynamicCache or no cache, or use plain generate().")
    text = inner.config.get_text_config(decoder=True)
    kinds = [type(layer) for layer in cache.layers] or [cache.layer_class_to_replicate] * text.num_hidden_layers
    expected = [type(layer) for layer in DynamicCache(config=text).layers]
    if kinds != expected:
        names = lambda ks: sorted({k.__name__ for k in ks})  # noqa: E731
        raise ValueError(f"The cache's {len(kinds)} layers ({names(kinds)}) are not the {len(expected)} layers "
                         f"({names(expected)}) generate() makes for {type(inner).__name__}: a cache of another "
                         "model, or one whose layers keep other keys than the model's masks (sliding windows) ask "
                         "for. Pass DynamicCache(config=model.config), or no cache.")
    past = cache.get_seq_length()
    if past == 0:
        return
    if any(length_dependent(m) for m in inner.modules()):
        raise ValueError("A cache cannot be continued with rotary embeddings that depend on the sequence length "
                         "(dynamic NTK, LongRoPE, whose Phi-3 models also recompute the cache past their original "
                         "length). Use plain generate().")
    windowed = sorted({k.__name__ for k in kinds if k is not DynamicLayer})
    if windowed:
        raise ValueError(f"A cache can be continued when every layer holds every token's keys and values; this "
                         f"one has {windowed} layers, which keep only the last window of them (sliding-window or "
                         "chunked attention). Pass the whole sequence as input_ids without a cache, or use plain "
                         "generate().")
    b, p = input_ids.shape
    lengths = {layer.get_seq_length() for layer in cache.layers}
    if lengths != {past}:
        raise ValueError(f"The cache's layers hold different numbers of tokens ({sorted(lengths)}): pass the cache "
                         "an earlier call returned, unchanged.")
    rows = {layer.keys.shape[0] for layer in cache.layers}
    if rows != {b}:
        why = f" (generate() repeats input_ids {config.num_return_sequences} times for num_return_sequences, not " \
              "the cache)" if config.num_return_sequences > 1 else ""
        raise ValueError(f"The cache holds {sorted(rows)} rows but the batch has {b}{why}: pass the cache of these "
                         "rows' earlier call.")
    covered = attention_mask.shape[1] if attention_mask is not None else getattr(config, "_mask_length", p)
    if covered != p or past >= p:
        raise ValueError(f"With a cache of {past} tokens, input_ids must be the whole sequence (the earlier call's "
                         f"sequences, then the new tokens), longer than the cache, and attention_mask must cover "
                         f"it; got {p} input ids and a mask of {covered}.")
    dtypes = {layer.keys.dtype for layer in cache.layers}
    if dtypes != {inner.dtype}:
        raise ValueError(f"The cache holds {sorted(map(str, dtypes))} keys and values, the model computes "
                         f"{inner.dtype}: pass the cache this model returned.")
