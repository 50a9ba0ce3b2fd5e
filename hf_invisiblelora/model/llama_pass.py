"""A Llama-shaped decoder's draft pass as plain functions, without Transformers' module calls.

On the CPU a draft pass at a few rows is mostly per-module overhead: SmolLM2-135M's int4 draft pass
at one row is about 6 ms of matmuls in 19 ms, the rest Python and small ops around 30 layers of
Transformers modules (docs/benchmarks.md). A draft pass only proposes tokens (the verify pass, the
model's own, decides what is committed), so it may run the same arithmetic by a shorter road (one
Python function per layer):

    run = draft_pass(inner, router, drafter, copy_of)   # None: the model's own forward
    logits = run(model, cache, masks, position_ids, ids, keep)   # forward.model_pass's signature

It computes op for op what Transformers' Llama, Mistral and Qwen2 classes compute (their decoder
layers, SDPA attention, gated MLP and RMSNorm: on the CPU the same logits, bit for bit; Mistral's and Qwen2's
sliding windows are in the masks layout.py builds), calls the embedding, rotary, final norm and head
modules as they are (their routes apply: routing.py), and runs each projection by ``copy_of(module)``,
the drafter's own copy of it (a low-precision one: low_precision.py). It applies only where all of
those modules are of these classes with the classes' own forward (a subclass, a forward another
library set on an instance or a route in the drafter's passes, or a hub kernel swapped in runs the
model's own pass), attention is SDPA, the model is in eval mode, no code of a user's sees the pass
(walk.foreign_hooks) and every projection has a copy. The model's own pass is the reference it is
tested against (tests/test_drafter.py).
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch.nn import functional as F
from transformers.modeling_utils import slice_logits_to_keep

from .walk import foreign_hooks

FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}  # Transformers' module: class prefix
ROLES = ("ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RMSNorm")
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


@functools.cache
def _families() -> dict:
    """{class prefix: {role: that class's forward}} of the classes this pass mirrors."""
    out = {}
    for name, prefix in FAMILIES.items():
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        out[prefix] = {role: getattr(module, prefix + role).forward for role in ROLES}
    return out


def draft_pass(inner, router, drafter, copy_of):
    """The pass of the module docstring for ``inner`` (the base causal LM) in ``drafter``'s passes
    (``router``: the pass context's), or None where it does not apply."""
    if inner.training or foreign_hooks(inner) or inner.config._attn_implementation != "sdpa":
        return None
    model = getattr(inner, "model", None)
    layers = getattr(model, "layers", None)
    if layers is None:
        return None
    forwards = next((f for f in _families().values() if type(inner).forward is f["ForCausalLM"]), None)
    if forwards is None:
        return None

    def mirrored(module, role):
        return type(module).forward is forwards[role] and router.runs_as_is(module, drafter)

    if not mirrored(inner, "ForCausalLM") or not mirrored(model, "Model"):
        return None
    plan = []
    for layer in layers[: model.config.num_hidden_layers]:
        parts = ((layer, "DecoderLayer"), (layer.self_attn, "Attention"), (layer.mlp, "MLP"),
                 (layer.input_layernorm, "RMSNorm"), (layer.post_attention_layernorm, "RMSNorm"))
        projections = [copy_of(getattr(getattr(layer, part), name)) for part, name in PROJECTIONS]
        if not all(mirrored(m, role) for m, role in parts) or any(p is None for p in projections):
            return None
        plan.append((layer, projections))
    kinds = getattr(model.config, "layer_types", None)

    def run(_, cache, masks, position_ids, ids, keep):
        cache.context.prepare_writes(cache.capacity)
        h = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, (layer, projections) in enumerate(plan):
            mask = masks[kinds[i]] if isinstance(masks, dict) else masks
            h = _layer(layer, projections, h, cos, sin, mask, cache, i)
        h = model.norm(h)
        return inner.lm_head(slice_logits_to_keep(h, keep))
    return run


def _layer(layer, projections, h, cos, sin, mask, cache, i):
    """Semantics: LlamaDecoderLayer.forward(h) with SDPA attention, the projections by ``projections``."""
    q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj = projections
    attn = layer.self_attn
    x = _rms_norm(layer.input_layernorm, h)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = q_proj(x).view(shape).transpose(1, 2)
    k = k_proj(x).view(shape).transpose(1, 2)
    v = v_proj(x).view(shape).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = cache.update(k, v, i)
    # As Transformers' sdpa_attention_forward calls it in our passes on the CPU (layout._use_gqa; our
    # passes always have masks, so never is_causal).
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                       enable_gqa=attn.num_key_value_groups > 1)
    h = h + o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1))
    x = _rms_norm(layer.post_attention_layernorm, h)
    return h + down_proj(layer.mlp.act_fn(gate_proj(x)) * up_proj(x))


def _rms_norm(norm, h):
    """Semantics: LlamaRMSNorm.forward(h)."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(h.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
