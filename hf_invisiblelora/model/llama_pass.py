"""A Llama-shaped decoder's passes as plain functions, without Transformers' module calls.

On the CPU a pass at a few rows is for a large part per-module overhead: SmolLM2-135M's int4 draft
pass at one row was about 6 ms of matmuls in 19 ms, the rest Python and small ops around 30 layers
of Transformers modules (docs/benchmarks.md). These functions run the same arithmetic by a shorter
road, one Python function per layer:

    direct = direct_pass(inner, router, drafter, copy_of)   # None: the model's own forward
    logits = direct(ids, masks, position_ids, cache, logits_to_keep)   # what the model's call gives
                                                         # (None: a pass it leaves to the model)

The pass computes op for op what Transformers' Llama, Mistral and Qwen2 classes compute (their decoder
layers, SDPA attention as Transformers calls it in our passes on the CPU, gated MLP and RMSNorm;
Mistral's and Qwen2's sliding windows are in the masks layout.py builds): the model's own logits, bit
for bit, and the same cache writes. The modules it does not mirror it calls as they are, so every
route of the pass applies (routing.py): the embedding, rotary, final norm and head, and each linear layer (LoRA
on: the LoRA layers, each row its adapter; a drafter's pass: LoRA off), the latter by its route
called directly (Router.direct: no hook is on them), or by ``copy_of(layer)`` where that gives the
drafter's own function for it (its low-precision copy).

It applies only where all the modules it mirrors are of these classes with the classes' own forward
and no route in the pass (a subclass, a forward another library set on an instance or a hub kernel
swapped in runs the model's own pass), attention is SDPA, the model is in eval mode on the CPU and
no code of a user's sees the pass (the caller checks: walk.foreign_hooks); a prompt's pass (which
computes as standard decoding's one call over the prompt did) runs the model's own forward. The
model's own pass is the reference it is tested against, bit for bit (tests/test_direct_pass.py).
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import torch
from torch.nn import functional as F
from transformers.modeling_utils import slice_logits_to_keep

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


def direct_pass(inner, router, drafter, copy_of=None):
    """The pass of the module docstring for ``inner`` (the base causal LM) in ``drafter``'s passes
    (None: the LoRA-on passes; ``router``: the pass context's), or None where it does not apply."""
    if inner.training or inner.device.type != "cpu" or inner.config._attn_implementation != "sdpa":
        return None
    model = getattr(inner, "model", None)
    layers = getattr(model, "layers", None)
    forwards = next((f for f in _families().values() if type(inner).forward is f["ForCausalLM"]), None)
    if layers is None or forwards is None:
        return None

    def mirrored(module, role):
        return type(module).forward is forwards[role] and router.runs_as_is(module, drafter)

    if not mirrored(inner, "ForCausalLM") or not mirrored(model, "Model"):
        return None
    plan = []
    for i, layer in enumerate(layers[: model.config.num_hidden_layers]):
        attn, norms = layer.self_attn, (layer.input_layernorm, layer.post_attention_layernorm)
        parts = ((layer, "DecoderLayer"), (attn, "Attention"), (layer.mlp, "MLP"), *((n, "RMSNorm") for n in norms))
        if not all(mirrored(m, role) for m, role in parts):
            return None
        linears = [getattr(getattr(layer, part), name) for part, name in PROJECTIONS]
        plan.append(_Layer(i, *((n.weight, n.variance_epsilon) for n in norms), attn.head_dim, attn.scaling,
                           attn.num_key_value_groups > 1, layer.mlp.act_fn,
                           [(copy_of and copy_of(m)) or router.direct(m, drafter) for m in linears]))
    kinds = getattr(model.config, "layer_types", None)

    def run(ids, masks, position_ids, cache, logits_to_keep):
        if masks is None or (isinstance(masks, dict) and None in masks.values()):
            return None  # Transformers' is_causal path (our passes always have masks)
        h = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(h, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer in plan:
            h = _layer(layer, h, cos, sin, masks[kinds[layer.index]] if isinstance(masks, dict) else masks, cache)
        h = model.norm(h)
        return inner.lm_head(slice_logits_to_keep(h, logits_to_keep))
    return run


class _Layer(NamedTuple):
    """What a decoder layer's pass reads, gathered once per call (module attribute lookups are slow)."""

    index: int
    norm1: tuple  # the input norm's (weight, epsilon)
    norm2: tuple  # the post-attention norm's
    head_dim: int
    scaling: float
    gqa: bool  # grouped key / value heads
    act: object
    projections: list  # q, k, v, o, gate, up, down: x -> y


def _layer(layer: _Layer, h, cos, sin, mask, cache):
    """Semantics: LlamaDecoderLayer.forward(h) with SDPA attention, its linear layers by ``layer.projections``."""
    q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj = layer.projections
    x = _rms_norm(h, *layer.norm1)
    shape = (*x.shape[:-1], -1, layer.head_dim)
    q = q_proj(x).view(shape).transpose(1, 2)
    k = k_proj(x).view(shape).transpose(1, 2)
    v = v_proj(x).view(shape).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = cache.update(k, v, layer.index)
    # As Transformers' sdpa_attention_forward calls it in our passes on the CPU (layout._use_gqa; our
    # passes always have masks, so never is_causal).
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling, enable_gqa=layer.gqa)
    h = h + o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1))
    x = _rms_norm(h, *layer.norm2)
    return h + down_proj(layer.act(gate_proj(x)) * up_proj(x))


def _rms_norm(h, weight, epsilon):
    """Semantics: LlamaRMSNorm.forward(h)."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * x.to(h.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
