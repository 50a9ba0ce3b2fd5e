"""The architecture sweep: a tiny random model for every causal-LM architecture in Transformers
(tests/test_architectures.py runs it; tools/arch_sweep_report.py writes docs/support.md from it;
not installed with the package). ``tiny_config`` derives it from the architecture's default config by
rules on attribute names (hidden sizes, layer counts, heads, experts, ...), so new architectures are
covered without a hand-written table; ``sweep_case`` builds it in float64 and wraps it with two PEFT
LoRA adapters ("s": all-linear r=4, "b": r=2 on attention-like projections); ``sweep_verdict``
compares ``invisible_lora=True`` with stock. Per-type overrides exist only where a generic rule
cannot work; each says why.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import warnings

import torch

from hf_invisiblelora.model.rotary import length_dependent
from hf_invisiblelora.model.walk import lora_layers
from tiny import EOS, PAD, prompts, with_adapters

# Target sizes. 4 heads x 16 = 64 hidden; 2 KV heads keep grouped-query attention grouped.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
EXPERT_INTERMEDIATE = 32
EXPERTS = 4
TOP_K = 2
STATE = 16  # SSM state size
MAX_POSITIONS = 128  # >= 64 tokens; also the size of learned position tables
WINDOW = 4  # shorter than the test prompts, so sliding windows really slide
CHUNK = 8  # attention / SSM chunk lengths: a few chunks within a test sequence
BOS = 2  # (PAD, EOS above)

# --- name rules; the first matching rule wins (see _shrink_value) ---------------------------------
_VOCAB = re.compile(r"vocab_size|_vocab$|^vocab$")  # not vocab_offset (an id offset)
_LAYERS = re.compile(
    r"^(num_hidden_layers|num_layers|n_layers?|num_decoder_layers|num_encoder_layers|decoder_layers|encoder_layers"
    r"|n_input_layers|n_output_layers|n_recurrent_layers|num_layers_per_stack|conf_num_hidden_layers"
    r"|num_global_layers|num_blocks)$")
_KV_HEADS = re.compile(r"(key_value_heads|kv_heads|num_query_groups|multi_query_group_num)$")
_HEADS = re.compile(r"(^|_)(heads|n_head|n_heads|num_heads|attention_heads|heads_per_layer|num_attention_heads)$")
# MLA (DeepSeek-style) low-rank attention sizes, which have their own consistency rules.
# nope + rope == HEAD_DIM, which some configs require of their non-MLA (sliding) layers.
_MLA = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16,
        "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16}
_HEAD_DIM = re.compile(r"(head_dim|head_size|d_head|dim_head|headdim|kv_channels|d_rel)$")
_EXPERT_SIZE = re.compile(r"(moe|expert|experts).*(intermediate|ffn|hidden)_size|(moe|expert)_ffn|moe_.*intermediate")
_INTERMEDIATE = re.compile(r"intermediate|ffn|^dff$|^d_inner$|^dim_ff$|^d_ff$|^n_inner$|feed_forward_size"
                           r"|^mamba_d_ssm$|^lru_width$|^mlp_dim$")
_TOPK = re.compile(r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|top_k|experts_per_token"
                   r"|num_selected_experts|moe_top_k|router_top_k)$")
_EXPERTS = re.compile(r"experts$|^moe_num_experts$|^num_local_experts$|^n_routed_experts$|^num_experts$")
_HIDDEN = re.compile(r"^dim$|(^|_)(hidden_size|d_model|n_embd|embed_dim|embedding_dim|emb_dim|embedding_size"
                     r"|word_embed_proj_dim|attention_hidden_size|router_hidden_size|hidden_dim)$|^hidden_size_")
_POSITIONS = re.compile(r"^(max_position_embeddings|n_positions|n_ctx|max_seq_len|max_target_positions"
                        r"|context_length|max_sequence_length|model_max_length)$")
_WINDOW = re.compile(r"^(sliding_window|sliding_window_size|attention_window_size|window_size|local_attention"
                     r"|local_attention_window_len|keep_window_size)$")
_CHUNK = re.compile(r"^(attention_chunk_size|chunk_size|mamba_chunk_size|index_block_size|block_size)$")
_STATE = re.compile(r"^(state_size|ssm_state_size|mamba_d_state|d_state)$")
# Attributes set to the tiny model's size whatever their value (the first pattern that matches).
_SIZES = ((_INTERMEDIATE, INTERMEDIATE), (_HIDDEN, HIDDEN), (_POSITIONS, MAX_POSITIONS), (_WINDOW, WINDOW),
          (_CHUNK, CHUNK), (_STATE, STATE))
_LOW_RANK = re.compile(r"(_rank|lowrank)$")  # small internal ranks (dt_rank, laurel_rank, gate ranks, ...)
_PERIOD = re.compile(r"(_period|_every|_every_n_layers|_step|_interval|sliding_window_pattern)$")
_OFFSET = re.compile(r"_offset$")

_SUBCONFIG = re.compile(r"(_config|^text_encoder|^audio_encoder|^decoder)$")  # nested config dicts


# --- per-type tables: only where a generic rule cannot work, each with the reason ---------------
# Config overrides (a dict value updates that key of a sub-config).
_OVERRIDES = {
    # attention_types encodes the layer pattern as [[pattern, repeats]]; attention_layers is derived from it.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # The layout stores (attention, mlp) block pairs and input/recurrent/output stacks that must add up.
    "dory": {"layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
             "num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2},
    # The default has no rope entry per layer type, which the model looks up (a checkpoint supplies it).
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                                   "mrope_section": [4, 2, 2]}}},
    # The default leaves the layer pattern to a checkpoint; one conv and one attention layer.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # The default makes every layer attention; LFM2 checkpoints interleave short-conv layers.
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    # The default leaves the sparse-attention indexer unset, which its "indexed_attention" layers need;
    # a budget of 4 tokens in blocks of 2 makes it sparse within the test sequences.
    "qwen4_exp_text": {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                       "indexer_budget": 4, "indexer_compress_ratio": 2},
    # Layers come in residual blocks of n_layers_per_attn_res_block, and the looped range must be whole
    # blocks: blocks of one layer, with the middle one of three looped.
    "inkling2_loop_text": {"n_layers_per_attn_res_block": 1, "num_hidden_layers": 3,
                           "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
                           "loop_layer_index_start": 1, "loop_layer_index_end": 2},
    # The cache rounds the q/k head size up to a multiple of 64 while the layers do not; a factor of 1
    # keeps both at hidden_size (64).
    "xlstm": {"qk_dim_factor": 1.0},
    # The attention reads attn_config.rope_theta and always clamps with clip_qkv; the default sets neither.
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # num_hidden_layers is rewritten as per-stack layers x cycles; None re-derives the stack size from it.
    "hrm_text": {"num_layers_per_stack": None},
    # The hybrid layers share one tied transformer block, which needs at least two hybrid layers.
    # Its attention runs on 2 x hidden (hidden states concatenated with the embeddings): head dim 128 / 4.
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3,
              "attention_head_dim": 2 * HIDDEN // HEADS},
    # The defaults have no attention layer, but the models read the attention cache length (mask
    # creation), so a pure-SSM stack fails; real checkpoints are hybrid.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # Axial position embeddings: the shape must multiply to max_position_embeddings, the dims add up to hidden.
    "reformer": {"axial_pos_shape": [8, MAX_POSITIONS // 8], "axial_pos_embds_dim": [HIDDEN // 4, 3 * HIDDEN // 4]},
}

# Types whose default config does not validate: kwargs for AutoConfig.for_model.
_DEFAULT_KWARGS = {
    # Assistant (drafter) models take no per-layer inputs; the text default has them.
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "gemma4_unified_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}


# Types that cannot decode from a text prompt alone, by design: the sweep builds and wraps them but
# does not generate.
SKIP_GENERATE = {
    "gemma4_assistant": "assistant (drafter) model: attends over the target model's shared KV states",
    "gemma4_unified_assistant": "assistant (drafter) model: attends over the target model's shared KV states",
    "musicgen": "audio-codebook LM: input_ids are (batch x num_codebooks) rows of audio codes",
    "musicgen_melody": "audio-codebook LM: input_ids are (batch x num_codebooks) rows of audio codes",
}


def causal_lm_architectures() -> list[str]:
    """The model types ``AutoModelForCausalLM`` knows, in the mapping's order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_class(model_type: str):
    """The class ``AutoModelForCausalLM`` builds for ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _top_config(model_type: str):
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(model_type, **copy.deepcopy(_DEFAULT_KWARGS.get(model_type, {})))


def default_config(model_type: str):
    """The architecture's default config, as the causal-LM class takes it.

    Where the class takes a sub-config of the type's config (MusicgenForCausalLM takes the decoder
    config of MusicgenConfig), that sub-config.
    """
    config = _top_config(model_type)
    wanted = getattr(causal_lm_class(model_type), "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        sub = [v for v in vars(config).values() if isinstance(v, wanted)]
        if sub:
            return sub[0]
    return config


def _shrink_value(key, value, heads_equal_kv, fixed=None):
    """The tiny value for one int attribute, or ``value`` when no rule applies."""
    if fixed and key in fixed:
        return fixed[key]
    if "multiple" in key or "divisible" in key:  # rounding granularity, not a size
        return value
    if key in _MLA:
        return _MLA[key]
    if _VOCAB.search(key):
        return None  # set by the caller (needs vocab_size)
    if _LAYERS.match(key):
        return None  # set by the caller (needs the layer selection)
    if _KV_HEADS.search(key):
        # Keep the attention kind: MHA (kv == heads), MQA (kv == 1) or GQA.
        return HEADS if heads_equal_kv else (1 if value == 1 else KV_HEADS)
    if _HEADS.search(key) and "index" not in key:
        return HEADS
    if key.startswith("index_"):  # sparse-attention indexer (DSA): heads, head dim, top-k tokens
        return {"index_n_heads": HEADS, "index_head_dim": HEAD_DIM, "index_topk": WINDOW}.get(key, value)
    if _HEAD_DIM.search(key):
        return HEAD_DIM
    if _TOPK.match(key):
        return min(value, TOP_K)
    if key in ("n_group", "num_expert_group"):  # group-limited routing: 2 groups of 2 experts
        return min(value, 2)
    if key == "topk_group":
        return 1
    if key == "rotary_dim":  # partial rotary embedding within one head
        return HEAD_DIM // 2
    if key == "query_pre_attn_scalar":  # Gemma's attention scale, head_dim in its checkpoints
        return HEAD_DIM
    if key == "zero_expert_num":  # LongCat's zero-computation experts, next to the routed ones
        return min(value, EXPERTS // 2)
    if _EXPERT_SIZE.search(key):
        return EXPERT_INTERMEDIATE
    if _EXPERTS.search(key) and "shared" not in key:
        return min(value, EXPERTS)
    size = next((size for pattern, size in _SIZES if pattern.search(key)), None)
    if size is not None:
        return size
    if _LOW_RANK.search(key) and value > 8:
        return 8
    return value


def _layer_count_key(d):
    for key in ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers"):
        if isinstance(d.get(key), int):
            return key
    return None


def _per_layer_lists(d, n_layers):
    """Keys of lists with one entry per layer, and keys of lists of layer indices."""
    per_layer, index_lists = [], []
    for key, value in d.items():
        if not isinstance(value, list) or not value or key.endswith("token_id"):
            continue
        is_index_list = (re.search(r"(layers|idxs|ids|indices|index)$", key)
                         and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                         and all(0 <= v < n_layers for v in value) and value == sorted(set(value))
                         and not (len(value) == n_layers and set(value) <= {0, 1} and value != list(range(n_layers))))
        if is_index_list:
            index_lists.append(key)
        elif len(value) == n_layers:
            per_layer.append(key)
    return per_layer, index_lists


def _thresholds(d):
    """Int attributes that split the layers at an index (first k dense, start/end of a range, ...)."""
    return {k: v for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool)
            and re.search(r"^first_k|^num_dense_layers$|layer_start_index$|layer_end_index$|layer_index_(start|end)$"
                          r"|^max_window_layers$|^num_kv_shared_layers$", k)}


def _layer_overrides(d):
    """``per_layer_config`` (heterogeneous layers): {layer index: {attribute: value}}."""
    plc = d.get("per_layer_config")
    return {int(k): v for k, v in plc.items()} if isinstance(plc, dict) else {}


def _keep_layers(d, n_layers, per_layer, index_lists, thresholds):
    """Old layer indices to keep: the first layer of each distinct kind, at least two layers.

    A layer's kind is its entry in every per-layer list, whether each index list names it and which
    side of each threshold it is on, so every layer type of a hybrid/periodic pattern survives.
    """
    overrides = _layer_overrides(d)

    def kind(i):
        sig = [repr(d[k][i]) for k in per_layer] + [i in d[k] for k in index_lists] + [repr(overrides.get(i))]
        sig += [i < v for k, v in thresholds.items() if k != "num_kv_shared_layers"]
        if "num_kv_shared_layers" in thresholds:
            sig.append(i >= n_layers - thresholds["num_kv_shared_layers"])
        return tuple(sig)

    keep, seen = [], set()
    for i in range(n_layers):
        if kind(i) not in seen:
            seen.add(kind(i))
            keep.append(i)
    for i in range(n_layers):  # pad to two layers with the next unused ones
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _size_context(d):
    """(heads_equal_kv, fixed): whether the attention is MHA, and tiny values that depend on the
    original ones (ratios to hidden_size, MLA dims tied to head_dim), ahead of the name rules."""
    heads_key = next((k for k in d if _HEADS.search(k) and isinstance(d[k], int)), None)
    kv_key = next((k for k in d if _KV_HEADS.search(k) and isinstance(d[k], int)), None)
    heads_equal_kv = heads_key is not None and kv_key is not None and d[heads_key] == d[kv_key]
    fixed = {}
    hidden = d.get("hidden_size")
    if isinstance(hidden, int) and hidden > 0:
        # Other hidden-like widths keep a whole ratio to hidden_size (Zamba's attention runs on
        # [hidden, embeddings] = 2 x hidden; ELECTRA's embeddings are hidden / 2).
        for key, value in d.items():
            if (key != "hidden_size" and isinstance(value, int) and not isinstance(value, bool) and value > 0
                    and _HIDDEN.search(key) and (value % hidden == 0 or hidden % value == 0)):
                fixed[key] = max(8, HIDDEN * value // hidden)
    if (isinstance(d.get("head_dim"), int) and isinstance(d.get("qk_nope_head_dim"), int)
            and isinstance(d.get("qk_rope_head_dim"), int)
            and d["head_dim"] > d["qk_nope_head_dim"] + d["qk_rope_head_dim"]):
        # MLA head dims next to a larger plain head_dim (Dots3: the sliding layers' head_dim equals
        # their own qk_nope + qk_rope) scale with it, so such relations hold in the tiny config.
        fixed.update({k: max(2, d[k] * HEAD_DIM // d["head_dim"]) for k in _MLA
                      if "head_dim" in k and isinstance(d.get(k), int)})
    elif isinstance(d.get("head_dim"), int) and d["head_dim"] == d.get("qk_rope_head_dim"):
        fixed["head_dim"] = _MLA["qk_rope_head_dim"]  # MLA models whose head_dim is the rotary part (LongCat)
    return heads_equal_kv, fixed


def _shrink_layers(d, heads_equal_kv, fixed):
    """Keep one layer of each kind (at least two layers), then cut per-layer lists, remap index
    lists, layer thresholds and per-layer overrides to the kept layers."""
    count_key = _layer_count_key(d)
    n_layers = d.get(count_key) if count_key else None
    for key in ("layer_types", "layers_block_type"):  # the authoritative length where present
        if isinstance(d.get(key), list):
            n_layers = len(d[key])
    if not n_layers:
        for key in d:  # no main stack (e.g. ProphetNet: encoder and decoder counts only)
            if _LAYERS.match(key) and isinstance(d[key], int):
                d[key] = min(d[key], 2)
        return
    for key, value in list(d.items()):
        if isinstance(value, int) and not isinstance(value, bool):
            if _PERIOD.search(key) and value > 2:
                d[key] = 2  # periodic patterns: period 2 keeps both kinds within 2 layers
            elif _OFFSET.search(key) and "vocab" not in key:
                d[key] = min(value, 1)
    min_layers = 2
    for key, value in list(d.items()):
        if (key.endswith("types") and isinstance(value, list) and 1 < len(value) < n_layers
                and all(isinstance(v, str) for v in value)):
            # A repeating pattern (RecurrentGemma's block_types): one of each kind, in order, and
            # as many layers as kinds so every kind is used.
            d[key] = list(dict.fromkeys(value))
            min_layers = max(min_layers, len(d[key]))
    per_layer, index_lists = _per_layer_lists(d, n_layers)
    thresholds = _thresholds(d)
    keep = _keep_layers(d, n_layers, per_layer, index_lists, thresholds)
    for key in per_layer:
        d[key] = [d[key][i] for i in keep]
    for key in index_lists:
        d[key] = [keep.index(i) for i in d[key] if i in keep]
    overrides = _layer_overrides(d)
    if overrides:
        width = len(next(iter(d["per_layer_config"])))  # keys are zero-padded strings, e.g. "05"
        d["per_layer_config"] = {str(new).zfill(width): _shrink_overrides(overrides[old], d, heads_equal_kv, fixed)
                                 for new, old in enumerate(keep) if old in overrides}
    for key, value in thresholds.items():
        if key == "num_kv_shared_layers":  # the last `value` layers share KV
            d[key] = sum(i >= n_layers - value for i in keep)
        elif "end" in key:  # inclusive end index
            d[key] = sum(i <= value for i in keep) - 1
        else:  # a count of leading layers / a start index
            d[key] = sum(i < value for i in keep)
    for key in list(d):
        if _LAYERS.match(key) and isinstance(d[key], int):
            # Other stacks (encoder, vision tower, ...) get at most 2 layers.
            d[key] = max(len(keep), min_layers) if key == count_key else min(d[key], 2)


def _shrink_dict(d, vocab_size, top_level=True):
    """A shrunk copy of one (sub-)config dict (``config.to_dict()``)."""
    d = copy.deepcopy(d)
    for key, value in list(d.items()):  # sub-configs (text/vision/audio, ...) first
        if isinstance(value, dict) and _SUBCONFIG.search(key) and "model_type" in value:
            d[key] = _shrink_dict(value, vocab_size, top_level=False)

    heads_equal_kv, fixed = _size_context(d)
    _shrink_layers(d, heads_equal_kv, fixed)

    for key, value in list(d.items()):
        if value is None and (_HEAD_DIM.search(key) or _KV_HEADS.search(key) or _EXPERTS.search(key)
                              or _TOPK.match(key)) and not key.startswith("index"):
            # Some defaults leave these to a checkpoint (None) although the modeling code needs them.
            value = d[key] = (HEADS if _KV_HEADS.search(key) else TOP_K if _TOPK.match(key)
                              else 1 if "shared" in key else EXPERTS)
        if isinstance(value, bool) or key in ("num_labels",) or key.endswith("token_id") or "token_index" in key:
            continue
        if isinstance(value, int) and value != 0:  # 0 switches a feature off (e.g. no per-layer inputs): keep it
            new = _shrink_value(key, value, heads_equal_kv, fixed)
            if new is None and _VOCAB.search(key):
                new = vocab_size
            if new is not None:
                d[key] = new
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            # Per-layer sizes (e.g. heads or intermediate size per layer) follow the scalar rule.
            if _HEADS.search(key) or _INTERMEDIATE.search(key) or _HIDDEN.search(key):
                d[key] = [_shrink_value(key, v, heads_equal_kv) for v in value]

    if top_level or "vocab_size" in d:  # a text sub-config carries the tokens generation reads too
        d["pad_token_id"], d["eos_token_id"] = PAD, EOS
        d["bos_token_id"] = BOS if d.get("bos_token_id") is not None else None  # keep "has a BOS" as is
    _fix_ssm(d)
    _fix_rope(d)
    return d


def _shrink_overrides(layer_values, d, heads_equal_kv, fixed):
    """A layer's overrides keep their ratio to the model-wide value (e.g. a full-attention layer's
    head_dim twice the others'); the model-wide value is shrunk by the usual rules."""
    out = {}
    for key, value in layer_values.items():
        base = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and isinstance(base, int) and base:
            tiny = _shrink_value(key, base, heads_equal_kv, fixed)
            out[key] = max(1, round(tiny * value / base)) if isinstance(tiny, int) else value
        else:
            out[key] = value
    return out


def _fix_ssm(d):
    """Mamba-2 style mixers: heads x head_dim must equal the inner size (expand x hidden, or d_ssm)."""
    expand = d.get("mamba_expand", d.get("expand"))
    if not isinstance(expand, int) or not isinstance(d.get("hidden_size"), int):
        return
    inner = d.get("mamba_d_ssm") or expand * d["hidden_size"]
    heads_key = next((k for k in ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads") if k in d), None)
    dim_key = next((k for k in ("mamba_d_head", "mamba_head_dim", "mamba_headdim") if k in d), None)
    if heads_key is None and "num_heads" in d and "head_dim" in d and "num_attention_heads" not in d:
        heads_key, dim_key = "num_heads", "head_dim"  # pure Mamba-2: its only heads are SSM heads
    if heads_key and dim_key and isinstance(d[dim_key], int):
        d[heads_key] = inner // d[dim_key]
    elif heads_key:  # head dim derived from the head count
        d[heads_key] = inner // HEAD_DIM
    for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        if isinstance(d.get(key), int):
            d[key] = 1  # groups must divide the SSM heads


def _fix_rope(d):
    """Per-frequency rope lists (longrope short/long factors) must have rotary_dim / 2 entries."""
    for params in _rope_param_dicts(d.get("rope_parameters")):
        head_dim = d.get("head_dim") or d.get("qk_rope_head_dim") or HEAD_DIM
        half = int(head_dim * params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0) or 1.0)) // 2
        for key in ("short_factor", "long_factor"):
            if isinstance(params.get(key), list):
                params[key] = params[key][:half]
        if isinstance(params.get("original_max_position_embeddings"), int):
            # Scaled rope types compare the context length with the original one.
            params["original_max_position_embeddings"] = min(params["original_max_position_embeddings"],
                                                             MAX_POSITIONS)
        if isinstance(params.get("mrope_section"), list):
            # Multimodal rope splits the rotary half into sections (t, h, w); rescale them to fit.
            sec, total = params["mrope_section"], sum(params["mrope_section"])
            new = [max(1, s * half // total) for s in sec]
            new[0] += half - sum(new)
            params["mrope_section"] = new


def _rope_param_dicts(rope):
    if not isinstance(rope, dict):
        return []
    if "rope_type" in rope or "rope_theta" in rope:
        return [rope]
    return [v for v in rope.values() if isinstance(v, dict)]  # one dict per layer type


def tiny_config(model_type: str, vocab_size: int = 64):
    """A tiny random config for ``model_type``, derived from its default config by name rules."""
    default = default_config(model_type)
    d = _drop_derived(_shrink_dict(default.to_dict(), vocab_size), type(default))
    for sub in d.values():  # a text sub-config gets its own type's overrides (qwen4_exp -> qwen4_exp_text)
        if isinstance(sub, dict) and sub.get("model_type") in _OVERRIDES:
            _merge(sub, copy.deepcopy(_OVERRIDES[sub["model_type"]]))
    for key in dict.fromkeys([model_type, d.get("model_type")]):  # qwen4_exp builds from its text config
        _merge(d, copy.deepcopy(_OVERRIDES.get(key, {})))
    kind = classify(model_type)
    if kind == "encoder-as-decoder":
        # BertLMHeadModel & co. attend causally only when told they decode (XLM: its causal flag).
        d["is_decoder"] = True
        if "causal" in d:
            d["causal"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return type(default).from_dict(d)


def _merge(d, updates):
    """Recursive dict update (overrides may touch one key of a sub-config)."""
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict) and key != "rope_parameters":
            _merge(d[key], value)
        else:
            d[key] = value


def _drop_derived(d, config_class):
    """Drop the attributes that are not init fields: ``__post_init__`` derives them (e.g. Zamba2's
    attention_hidden_size = 2 x hidden_size), so they are re-derived from the shrunk fields."""
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    fields = {f.name for f in dataclasses.fields(config_class)}
    keep = fields | {f.name for f in dataclasses.fields(PreTrainedConfig)} | {"model_type", "_name_or_path",
                                                                               "transformers_version"}
    # to_dict() may export a field under its attribute_map name (Kimi-Linear: num_experts for the
    # field num_local_experts): rename those back instead of dropping them.
    alias = {name: field for name, field in config_class.attribute_map.items() if field in fields}
    alias.update({name: field for field, name in config_class.attribute_map.items() if field in fields})
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value.get("model_type") in CONFIG_MAPPING:
            value = _drop_derived(value, CONFIG_MAPPING[value["model_type"]])
        if key not in keep and key in alias:
            out[alias[key]] = value
        elif key in keep or isinstance(value, dict):
            out[key] = value
    return out


def classify(model_type: str) -> str:
    """"decoder-only", "decoder-of-encoder-decoder" or "encoder-as-decoder" for the causal-LM class.

    The last two can still generate from a prompt alone: the decoder of e.g. BART without
    cross-attention, or an encoder (BERT) whose LM-head class attends causally when is_decoder=True.
    """
    from transformers.models.auto import modeling_auto as ma

    config = _top_config(model_type)  # the whole model's config: Musicgen's decoder config alone says "decoder-only"
    seq2seq = set(ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES) | set(ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
    if getattr(config, "is_encoder_decoder", False) or model_type in seq2seq:
        return "decoder-of-encoder-decoder"
    if model_type in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES or ma.MODEL_MAPPING_NAMES.get(model_type, "").endswith(
            "Encoder"):  # BERT & co.; BertGeneration's base model is BertGenerationEncoder
        return "encoder-as-decoder"
    try:
        init_source = inspect.getsource(causal_lm_class(model_type).__init__)
    except (OSError, TypeError):
        init_source = ""
    if "is_decoder" in init_source:  # a decoder for someone else's encoder (TrOCR in VisionEncoderDecoder)
        return "decoder-of-encoder-decoder"
    return "decoder-only"


def is_multimodal(model_type: str) -> bool:
    """Whether the causal-LM class for the type also takes images/audio (it then runs text-only here).

    Judged by the class, not the type: "llama4" is multimodal but its causal-LM class is text-only.
    """
    from transformers.models.auto import modeling_auto as ma

    name = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    multimodal = set(ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())
    multimodal |= set(getattr(ma, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}).values())
    return name in multimodal or "ConditionalGeneration" in name


def _linear_names(model):
    """Qualified names of the Linear/Conv1D layers PEFT's all-linear targets (all but the output head)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head]


def attention_targets(model) -> list[str]:
    """Leaf names for adapter "b": the query/value projections (the usual LoRA default), else other
    attention-like projections, else the first two linear names (attention-free models)."""
    names = _linear_names(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    qv = [leaf for leaf in leaves if re.search(r"(^|_)(q|v|wq|wv|query|value|qkv|wqkv|c_attn)(_|$)", leaf, re.I)]
    if qv:
        return qv
    attn = sorted({n.rsplit(".", 1)[-1] for n in names if re.search(r"attn|attention|mixer|self_att", n)})
    # Every other one, so "b" targets a proper subset where there is more than one.
    return attn[::2] if attn else leaves[:2]


def build_tiny_model(model_type: str, vocab_size: int = 64, seed: int = 0, edit=None):
    """(model, dtype note): the tiny random model in float64 in eval mode, or float32 with the reason.
    ``edit(config)``: a change to the tiny config before the model is built."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = tiny_config(model_type, vocab_size)
    if edit is not None:
        edit(config)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Eager experts: the default grouped_mm MoE kernel takes no float64 (and eager is the
        # plain per-expert loop, the reference a lossless test wants anyway).
        if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
            model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
        else:  # the class takes a sub-config (see default_config), which the auto mapping does not list
            model = causal_lm_class(model_type)._from_config(config, experts_implementation="eager")
    model.eval()
    _prepare(model)
    model64 = copy.deepcopy(model).to(torch.float64)
    error64 = _probe(model64)
    if error64 is None:
        return model64, "float64"
    if _probe(model) is None:  # float32 runs: float64 is the problem
        return model, f"float32 (float64 failed: {type(error64).__name__}: {_short(error64)})"
    return model64, "float64"  # fails in both dtypes: not a dtype matter, generate() reports it


def _prepare(model):
    """Per-model switches a bare forward needs."""
    if hasattr(model, "set_default_language"):  # X-MOD: one language adapter per forward
        model.set_default_language(model.config.languages[0])


def _probe(model):
    """None if a short greedy generate runs (prefill and cached steps), else the exception."""
    ids = torch.tensor([[3, 4, 5]])
    try:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
        return None
    except Exception as exc:  # noqa: BLE001 - the caller reports it
        return exc


def unmixable_modules(model) -> set[str]:
    """Names of Linear layers PEFT cannot run in a mixed-adapter batch (``adapter_names=``), found by
    running the model: layers that see the tokens flattened, so their rows are no longer the batch
    (MoE routers and experts, OPT's MLP), and Linear subclasses with their own forward whose output
    is not x @ W.T (grouped projections), where a LoRA update does not fit."""
    flagged, hooks, batch = set(), [], [0]
    modules = dict(model.named_modules())

    def hook(name):
        def check(module, args, out):
            x = args[0] if args else None
            if not torch.is_tensor(x):
                return
            width = getattr(module, "out_features", getattr(module, "nf", None))
            if (x.dim() < 2 or x.shape[0] != batch[0] or not torch.is_tensor(out)  # e.g. a router returning a tuple
                    or out.shape[:-1] != x.shape[:-1] or out.shape[-1] != width):
                flagged.add(name)
        return check

    for name in _linear_names(model):
        hooks.append(modules[name].register_forward_hook(hook(name)))
    try:
        for rows, length in ((3, 6), (2, 5)):  # two batch sizes, so an expert seeing exactly `rows` tokens is still caught
            batch[0] = rows
            ids = torch.arange(rows * length).reshape(rows, length) % 50 + 3
            with torch.no_grad():
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
    except Exception:  # noqa: BLE001 - a model that cannot run alone has nothing to flag
        pass
    finally:
        for h in hooks:
            h.remove()
    return flagged


# Model types for which PEFT (tuners_utils._check_lora_target_modules_mamba) rejects out_proj/conv1d.
_PEFT_MAMBA_TYPES = {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}


def _wrap(model, targets_a, targets_b, exclude):
    exclude = exclude or None
    return with_adapters(model, {"s": dict(r=4, lora_alpha=8, target_modules=targets_a, exclude_modules=exclude),
                                 "b": dict(r=2, lora_alpha=4, target_modules=targets_b, exclude_modules=exclude)})


def wrap_with_lora(model, mixed_batch_safe=True):
    """(peft_model, note): adapter "s" (all-linear, r=4) and "b" (r=2 on attention-like projections).

    With ``mixed_batch_safe``, when PEFT's all-linear lands on layers its mixed-batch forward cannot
    run (fused MoE expert parameters, which PEFT wraps as lora.ParamWrapper, and the layers
    ``unmixable_modules`` finds), "s" becomes the same targets minus those; the note says which.
    """
    from peft.tuners.lora import ParamWrapper

    targets_b = attention_targets(model)  # before wrapping: get_peft_model adds lora_A/B modules in place
    exclude = []
    if getattr(model.config, "model_type", None) in _PEFT_MAMBA_TYPES:
        # PEFT refuses LoRA on Mamba's out_proj/conv1d (its fused kernels read those weights directly).
        exclude = ["out_proj", "conv1d"]
        targets_b = [t for t in targets_b if t not in exclude] or ["in_proj"]
    if not mixed_batch_safe:
        return _wrap(model, "all-linear", targets_b, exclude), ""

    flagged = unmixable_modules(model)
    if flagged and flagged >= set(_linear_names(model)):
        raise ValueError("no linear layer can run in a PEFT mixed batch (all see the tokens flattened or "
                         f"sequence-first): {sorted({n.rsplit('.', 1)[-1] for n in flagged})}")
    pristine = copy.deepcopy(model)  # get_peft_model changes the model in place
    peft_model = _wrap(model, "all-linear", targets_b, exclude + sorted(flagged))
    params = sorted(peft_model.peft_config["s"].target_parameters or [])
    if params and any(isinstance(m, ParamWrapper) for m in peft_model.modules()):
        # Rewrap: "s" on the module names PEFT resolved all-linear to, without the parameter targets.
        resolved = sorted(peft_model.peft_config["s"].target_modules)
        peft_model = _wrap(pristine, resolved, targets_b, exclude + sorted(flagged))
    dropped = sorted({n.rsplit(".", 1)[-1] for n in flagged})
    parts = ([f"fused expert parameters {params}"] if params else []) + ([f"layers {dropped}"] if dropped else [])
    note = "adapter s: all-linear without what PEFT cannot run in a mixed batch: " + ", ".join(parts) if parts else ""
    return peft_model, note


def sweep_case(model_type: str, vocab_size: int = 64, seed: int = 0, edit=None):
    """(peft_model or None, reason). The reason says why there is no model, or notes what to know
    (float32 fallback, multimodal class, decoder of an encoder-decoder); "" when nothing."""
    notes = []
    kind = classify(model_type)
    if kind != "decoder-only":
        notes.append(kind)
    if is_multimodal(model_type):
        notes.append("multimodal class, text-only inputs")
    try:
        model, dtype_note = build_tiny_model(model_type, vocab_size, seed, edit)
    except Exception as exc:  # noqa: BLE001 - the reason is reported
        return None, "; ".join(notes + [f"cannot build: {type(exc).__name__}: {_short(exc)}"])
    if dtype_note != "float64":
        notes.append(dtype_note)
    try:
        torch.manual_seed(seed + 1)
        peft_model, wrap_note = wrap_with_lora(model)
    except Exception as exc:  # noqa: BLE001
        return None, "; ".join(notes + [f"PEFT cannot wrap: {type(exc).__name__}: {_short(exc)}"])
    return peft_model, "; ".join(notes + [wrap_note] if wrap_note else notes)


def _short(exc, n=160):
    text = " ".join(str(exc).split())
    return text if len(text) <= n else text[: n - 3] + "..."


# The sweep: each architecture decodes as stock PEFT with invisible_lora=True, or is refused.
SWEEP_NAMES = ["s", "__base__", "b"]
SWEEP_NEW = 12


def _stock(model, ids, mask):
    """Stock greedy decoding, or None when its logits are not finite (some architectures' padded rows
    are NaN in stock Transformers: nothing to compare)."""
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=SWEEP_NAMES, do_sample=False,
                         max_new_tokens=SWEEP_NEW, output_logits=True, return_dict_in_generate=True)
    return out.sequences if all(torch.isfinite(x).all() for x in out.logits) else None


def _lora_state(model):
    return [("forward" in vars(m), m._disable_adapters, len(m._forward_pre_hooks)) for m in lora_layers(model)]


def dynamic_rope(config):
    """Dynamic NTK RoPE switching at 8 positions (the 6-token prompts plus 12 new tokens cross it)."""
    text = config.get_text_config(decoder=True)
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type") == "default":
        text.rope_parameters = {**rope, "rope_type": "dynamic", "factor": 2.0}
        text.max_position_embeddings = 8


def sweep_verdict(arch, edit=None):
    """("identical", note) / ("refused", message) / ("skipped", reason); asserts on any other outcome."""
    if arch in SKIP_GENERATE:
        return "skipped", SKIP_GENERATE[arch]
    model, note = sweep_case(arch, edit=edit)
    if model is None:
        return "skipped", note
    if edit is dynamic_rope and not any(length_dependent(m) for m in model.modules()):
        return "skipped", "no rotary embedding that takes rope_parameters['rope_type'] = 'dynamic'"
    ids, mask = prompts([3, 6, 5], low=3)  # tokens clear of pad / eos / bos
    try:
        ref = _stock(model, ids, mask)
    except Exception as e:  # a Transformers bug: nothing to compare
        return "skipped", f"stock generate fails: {type(e).__name__}: {e}"
    if ref is None:  # compare without padding
        ids, mask = prompts([6, 6, 6], low=3)
        ref = _stock(model, ids, mask)
        note = "; ".join(filter(None, [note, "unpadded prompts (stock's padded rows are not finite)"]))
    assert ref is not None, "stock decoding is not finite"
    before = _lora_state(model)
    for k in (1, 3):
        passes = []  # a refusal comes before the first forward pass; a ValueError after it is a failure
        hook = model.get_base_model().register_forward_pre_hook(lambda *_: passes.append(1))
        try:
            out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=SWEEP_NAMES, do_sample=False,
                                 max_new_tokens=SWEEP_NEW, invisible_lora=True, num_draft_tokens=k, gate="always")
        except ValueError as refusal:
            assert not passes, f"K={k}: ValueError while decoding (not a refusal before it): {refusal}"
            assert _lora_state(model) == before, "a refused call changed the model"
            return "refused", str(refusal)
        finally:
            hook.remove()
        assert torch.equal(out, ref), f"K={k}: {out.tolist()} != stock {ref.tolist()}"
        assert _lora_state(model) == before
    return "identical", note
