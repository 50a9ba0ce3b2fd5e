"""hf-invisiblelora: lossless fast multi-LoRA decoding for Transformers + PEFT.

``import hf_invisiblelora`` makes ``generate()`` of PEFT causal-LM models accept
``invisible_lora=True``; ``hf_invisiblelora.generate(model, ...)`` does the same without the flag.
"""

import contextlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import warnings


def _kernels_from_source() -> None:
    """From a source checkout (its root on ``sys.path``: python without ``-P`` there, a notebook, an
    editable install), the top-level ``kernels/`` folder is this package's ``kernels`` subpackage, as
    setup.cfg maps it at install. It has no ``__init__.py``, so that the checkout's folder on ``sys.path``
    cannot shadow the import name ``kernels``, Hugging Face's package (Transformers imports it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(os.path.dirname(here), "kernels")
    name = f"{__name__}.kernels"
    if name in sys.modules or os.path.isdir(os.path.join(here, "kernels")) or \
            not os.path.isfile(os.path.join(folder, "meta.py")):
        return
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [folder]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    globals()["kernels"] = module


@contextlib.contextmanager
def _quiet_imports():
    """PEFT imports torchao and bitsandbytes where they are installed, and on a CPU they log that
    their CUDA libraries and kernels cannot load (and torch that torchao registers enums the old
    way): nothing a user can act on. Those loggers are set to errors while we import, then back."""
    names = ("torchao", "torch.utils._pytree", "bitsandbytes")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


_kernels_from_source()
# PEFT reads Transformers' deprecated ``is_gradient_checkpointing`` whenever it wraps a model (PeftModel,
# load_adapter): a FutureWarning a user cannot act on. Exactly that message, from that module, is silenced.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                        module="transformers.modeling_utils")
with _quiet_imports():
    from .api import InvisibleLoRAOutput, generate, install, warm_up
    from .decode.stats import DecodingStats
    from .model.state import state_of

install()

__all__ = ["generate", "install", "warm_up", "state_of", "DecodingStats", "InvisibleLoRAOutput"]
