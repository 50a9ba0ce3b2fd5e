"""hf-invisiblelora: lossless fast multi-LoRA decoding for Transformers + PEFT.

``import hf_invisiblelora`` makes ``generate()`` of PEFT causal-LM models accept
``invisible_lora=True``; ``hf_invisiblelora.generate(model, ...)`` does the same without the flag.
"""

from .api import InvisibleLoRAOutput, generate, install, warm_up
from .state import state_of
from .stats import DecodingStats

install()

__all__ = ["generate", "install", "warm_up", "state_of", "DecodingStats", "InvisibleLoRAOutput"]
