"""Where each row's tokens sit, and what a pass tells the model about them: masks and positions.

Slot j of row b holds token j of that row, where standard decoding puts it (its cache position):
the prompt at 0..P-1 as given (any padding pattern), then the generated tokens. Two tables,
computed once per call the way generate() computes them, describe every slot:

    valid[b, j]      slot j may be attended to: the prompt's attention_mask, then ones
    positions[b, j]  position id: the prompt's position_ids (given, or cumsum(mask) - 1 with 0 at
                     masked slots), then last + 1, last + 2, ...

A pass runs each row at its own slots (rows commit different numbers of tokens per cycle). Its
attention masks are the model's own: one per layer type, made by the function the model makes it
with (Transformers' create_causal_mask, create_sliding_window_causal_mask, ...; ``mask_makers``),
whose mask function is evaluated here at every row's own query slots instead of one shared
offset. Standard decoding's cache can narrow that further: a sliding-window cache layer keeps
only the last ``window`` keys for every step after the prompt's, whatever the mask function says
(a model may build plain causal masks on a config with a window). The result has the format of the
model's attention implementation (boolean for sdpa, additive for eager), so the model uses it as given.
"""

from __future__ import annotations

import copy
import sys
from typing import NamedTuple

import torch
from transformers import masking_utils
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.integrations import sdpa_attention
from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING, AttentionMaskInterface

from .context import in_pass

ROW_MASKS = "hf_invisiblelora_rows"  # our mask interface's name in Transformers' registry
ATTENTION = ("sdpa", "eager")  # attention implementations whose masks we can build


class _MaskSpec(NamedTuple):
    """What our mask interface reads from the config it is handed: the decoder's pass context
    (its query slots, prefix), the window of the cache layers this mask is for, and the model's
    attention implementation (the mask's format)."""

    context: object
    window: int | None
    implementation: str


def _row_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              use_vmap=False, config=None, dtype=torch.float32, **kwargs):
    """Transformers' mask-interface signature; ``config.invisiblelora`` is a _MaskSpec."""
    spec = config.invisiblelora
    query = spec.context.query  # [B, q] slot of every query token
    device = query.device
    b = torch.arange(batch_size, device=device)[:, None, None, None]
    h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    kv = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
    visible = mask_function(b, h, query[:, None, :, None], kv)
    if attention_mask is not None:
        visible = visible & attention_mask[:, None, None, kv_offset : kv_offset + kv_length]
    if spec.window is not None and spec.context.prefix is None:  # standard decoding's cache keeps the last `window` keys
        visible = visible & (kv > query[:, None, :, None] - spec.window)
    visible = visible.expand(batch_size, 1, q_length, kv_length)
    if spec.implementation == "eager":  # eager attention adds the mask
        return torch.where(visible, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
    return visible


AttentionMaskInterface.register(ROW_MASKS, _row_mask)

# Grouped KV heads without copies. Transformers' SDPA path copies every key/value head for its
# query heads (repeat_kv: the whole cache, every layer, every pass) unless it asks torch's SDPA to
# group them (enable_gqa), which it does on the CPU only when there is no mask. With a mask torch's
# CPU kernels give the same bits either way (tests/test_configurations.py checks it); skipping the
# copy made compiled SmolLM2 passes at batch 16 11-22% cheaper (eager passes and batch 1: within
# noise; docs/benchmarks.md), so our passes ask for it. Only our passes (the thread is running a
# pass context); everything else gets Transformers' choice. Global: Transformers looks the
# function up in its module at every attention call, with nothing of the call to tell passes apart.
_stock_use_gqa = getattr(sdpa_attention, "use_gqa_in_sdpa", None)


def _use_gqa(attention_mask, key, value) -> bool:
    if in_pass() and key.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
        return True
    return _stock_use_gqa(attention_mask, key, value)


if _stock_use_gqa is not None:
    sdpa_attention.use_gqa_in_sdpa = _use_gqa


def mask_makers(model, config) -> dict:
    """How ``model`` makes its attention masks: {layer type: Transformers' mask function} when its
    config has ``layer_types`` (the model then takes a dict of masks), else {None: the one function
    whose mask every layer gets}.

    Transformers' ``create_masks_for_generate`` is the model of this (it prepares the masks of
    compiled decoding), but a config's ``sliding_window`` or ``attention_chunk_size`` alone does not
    mean the model slides: some models never call the sliding-window mask function. Those
    functions are imported by name into each modeling file, so a model that does not import one
    cannot use it.
    """
    if hasattr(config, "layer_types"):
        kinds = set(config.layer_types) & set(LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING)
        return {t: LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[t] for t in kinds}
    module = vars(sys.modules[type(model).__module__])
    for attribute, name in (("sliding_window", "create_sliding_window_causal_mask"),
                            ("attention_chunk_size", "create_chunked_causal_mask")):
        if getattr(config, attribute, None) is not None and name in module:
            return {None: getattr(masking_utils, name)}
    return {None: masking_utils.create_causal_mask}


def prompt_positions(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids of the prompt as generate() derives them when none are given."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 0)


class RowLayout:
    """Slot tables of a decoder's rows (see the module docstring) and the masks / positions of each
    pass, as its pass context (context.py) describes it.

    ``capacity`` rows of ``width`` slots; ``load`` fills the rows a prompt starts on.
    """

    def __init__(self, model, capacity: int, width: int, device, context):
        self.width, self.context = width, context
        self.valid = torch.ones(capacity, width, dtype=torch.bool, device=device)
        self.positions = torch.zeros(capacity, width, dtype=torch.long, device=device)
        text = model.config.get_text_config(decoder=True)
        makers = mask_makers(model, text)
        kinds, kwargs = get_layer_types_and_kwargs(text)
        windows = {kind: kw.get("sliding_window") for kind, kw in zip(kinds, kwargs)}
        implementation = text._attn_implementation or "eager"
        self.makers = {}
        for kind, make in makers.items():
            # A copy of the config per mask that names our mask interface: the model's own config
            # and attention implementation stay untouched, and concurrent calls do not share it.
            # The window: of the cache layers whose mask this maker makes (one maker: the first layer's).
            config = copy.copy(text)
            config._attn_implementation_internal = ROW_MASKS
            config.invisiblelora = _MaskSpec(context, windows.get(kind if kind is not None else kinds[0]), implementation)
            self.makers[kind] = (make, config)
        self.dtype = model.dtype

    def load(self, idx, prompt_mask, positions, last_used: list[int]) -> None:
        """Rows ``idx`` start on a prompt of P slots: its attention mask (None: all ones) and position
        ids [n, P]. ``last_used[i]``: the last slot standard decoding would feed for that row (its
        P + max_new - 2); slots past it (drafts of rows that are ahead) get its position, so learned
        position tables are never read past what standard decoding reads."""
        n, p = positions.shape
        valid = torch.ones(n, self.width, dtype=torch.bool, device=positions.device)
        if prompt_mask is not None:
            valid[:, :p] = prompt_mask.bool()
        after = positions[:, -1:] + torch.arange(1, self.width - p + 1, device=positions.device)
        table = torch.cat([positions.long(), after], 1)
        for i, last in enumerate(last_used):
            table[i, last + 1 :] = table[i, last]
        self.valid[idx], self.positions[idx] = valid, table

    def inputs(self):
        """Masks (a tensor, or a dict by layer type) and position_ids [b, q] of the pass the context
        describes (its rows, query slots and kv_len)."""
        p = self.context
        rows = p.rows if isinstance(p.rows, torch.Tensor) else slice(0, p.start.shape[0])
        valid, positions = self.valid[rows], self.positions[rows]
        embeds = torch.empty(p.start.shape[0], p.q, 0, dtype=self.dtype, device=p.start.device)
        masks = {kind: make(config, embeds, valid[:, : p.kv_len], cache=None) for kind, (make, config) in self.makers.items()}
        return masks.get(None, masks), positions.gather(1, p.query.clamp(max=self.width - 1))
