"""An adapter put into a PEFT model, written into its tensors, or taken out: each all or nothing, and
never touching the other adapters (their order in PEFT's containers included: the adapter bank's
slots follow it). The serving engine's adapter manager (engine/adapters.py) makes every change to
the model through these.

    add_adapter(model, key, files, check)        # PEFT's load_adapter on read files (lora/files.py)
    overwrite_adapter(model, key, files, check)  # the same modules, new weights (a training checkpoint)
    remove_adapter(model, key)                   # every trace of it

``add_adapter`` is PEFT's own ``load_adapter`` on read contents (``add_adapter`` +
``set_peft_model_state_dict``); if anything fails midway, every module PEFT injected for the key is
removed again (PEFT's rollback removes only the config entry), so the model is as before. PEFT's
errors for contents that do not fit the model are files.Unreadable (the folder's fault: a client's 400).
"""

from __future__ import annotations

from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import delete_adapter as peft_delete_adapter
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from .files import AdapterFiles, Unreadable


def remove_adapter(model, name: str) -> None:
    """Every trace of adapter ``name`` in the PEFT model: its config entry and whatever PEFT injected
    for it in any layer (also where a failed injection left its modules and the config entry is
    gone already). Another adapter is made the active one first if it was: PEFT takes the next one
    from its first LoRA layer, and where that layer holds no other, the model's active adapter
    would stay the deleted one (then every PEFT call on the model fails)."""
    if name in model.active_adapters:
        others = [a for a in model.peft_config if a != name]
        if others:
            model.set_adapter(others[0], inference_mode=True)
    model.peft_config.pop(name, None)
    peft_delete_adapter(model.base_model.model, name, prefix="lora_", layer_cls=LoraLayer)


def add_adapter(model, name: str, files: AdapterFiles, check=None) -> None:
    """PEFT's ``load_adapter`` on ``files`` (injection, then the weights; in eval mode), then
    ``check()`` if given (it raises to refuse the adapter); or, if any of it fails, the model exactly
    as it was: the adapter removed (``remove_adapter``) and every module PEFT put in place of
    another (a LoRA wrapper around a layer no adapter targeted before) put back; then the error is
    raised."""
    before = [(parent, key, child) for parent in model.modules() for key, child in parent._modules.items()]
    try:
        try:
            model.add_adapter(name, files.config, autocast_adapter_dtype=True)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:  # PEFT's words for a config it cannot apply here
            raise Unreadable(f"PEFT cannot add the adapter to this model: {_one_line(e)}") from e
        _load_weights(model, name, files.weights)
        model.eval()
        if check is not None:
            check()
    except BaseException:
        remove_adapter(model, name)
        for parent, key, child in before:
            if parent._modules.get(key) is not child:
                parent._modules[key] = child
        raise


# Config fields that say where an adapter came from, not what modules it builds.
_PROVENANCE = ("base_model_name_or_path", "revision", "inference_mode", "peft_version")


def same_layout(model, name: str, config: LoraConfig) -> bool:
    """Whether ``config`` builds the modules adapter ``name`` has (every field equal but provenance):
    its weights can then replace the adapter's in place (``overwrite_adapter``)."""
    here, there = (c.to_dict() for c in (model.peft_config[name], config))
    for d in (here, there):
        for key in _PROVENANCE:
            d.pop(key, None)
    return here == there


def overwrite_adapter(model, name: str, files: AdapterFiles, check=None) -> None:
    """Adapter ``name``'s weights replaced by ``files``' in its own tensors (``same_layout``: no
    module built, which PEFT's injection takes most of a load's time for), then ``check()`` if
    given; or, if any of it fails, its old weights back and the error raised."""
    old = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    try:
        _load_weights(model, name, files.weights)
        _clear_caches(model)
        if check is not None:
            check()
    except BaseException:
        set_peft_model_state_dict(model, old, adapter_name=name)
        _clear_caches(model)
        raise


def _load_weights(model, name: str, weights: dict) -> None:
    """PEFT's state dict ``weights`` into adapter ``name``'s tensors; Unreadable if it lacks some."""
    device = next(model.parameters()).device
    try:
        result = set_peft_model_state_dict(model, {k: v.to(device) for k, v in weights.items()}, adapter_name=name)
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # PEFT's and torch's words for tensors that do not fit
        raise Unreadable(f"the adapter's weights do not fit this model's layers (made for another model?): "
                         f"{_one_line(e)}") from e
    missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
    if missing:
        raise Unreadable(f"the adapter's weights lack {len(missing)} of its layers' tensors, e.g. "
                         f"{missing[0].replace('.' + name, '')!r} (made for another model?)")


def _one_line(error: Exception) -> str:
    """``error``'s message on one line, at most 300 characters (PEFT's load errors run to thousands)."""
    return " ".join(str(error).split())[:300]


def _clear_caches(model) -> None:
    for m in model.modules():  # PEFT's ad hoc per-adapter values (DoRA's): computed again from the weights
        if isinstance(getattr(m, "_caches", None), dict):
            m._caches.clear()
