"""The zoo on disk: ``<cache>/zoo/<model>/`` holds one folder per trained adapter and a
``manifest.json`` (each adapter's recipe, held-out loss on its own domain, base vs adapter,
training time, and the measured acceptance). Build the missing adapters, load them, measure them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tqdm import tqdm  # text bars: tqdm.auto needs ipywidgets in a notebook

from . import assets, corpora
from .assets import AssetUnavailable, log
from .recipes import ZOOS, Recipe, train_adapter


def zoo_dir(model: str) -> Path:
    return assets.home() / "zoo" / model


def read_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else {"adapters": {}}


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write atomically: the manifest is rewritten after every adapter of a long build."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / "manifest.json")


def is_built(folder: Path, name: str, manifest: dict) -> bool:
    return name in manifest["adapters"] and (folder / name / "adapter_model.safetensors").exists()


def is_plain(entry: dict) -> bool:
    """Whether a manifest entry is a plain LoRA adapter: no DoRA, no module trained whole (which
    stock PEFT's mixed batch refuses, and compiled passes do not take)."""
    return not entry["recipe"].get("dora") and not entry["recipe"].get("modules_to_save")


def built_adapters(model: str, plain_only: bool = True) -> list[str]:
    """The zoo's built adapters, in manifest order (``plain_only``: its plain LoRA ones, ``is_plain``)."""
    folder = zoo_dir(model)
    manifest = read_manifest(folder)
    return [n for n, e in manifest["adapters"].items()
            if is_built(folder, n, manifest) and (is_plain(e) or not plain_only)]


def adapter_path(model: str, adapter: str) -> Path:
    """The folder of zoo adapter ``adapter`` of ``model`` (a PEFT adapter folder: PeftModel.from_pretrained
    and the server's --lora take it), trained first if it is not built yet."""
    if adapter not in ZOOS[model]:
        raise ValueError(f"{adapter!r} is not an adapter of the {model} zoo; it has {sorted(ZOOS[model])}.")
    folder = zoo_dir(model)
    if not is_built(folder, adapter, read_manifest(folder)):
        build(model, [adapter])
    return folder / adapter


def build(model: str = "smollm2", only: list[str] | None = None, recipes: dict[str, Recipe] | None = None) -> Path:
    """Train the zoo's missing adapters (or only the named ones); return the zoo folder."""
    import torch
    from transformers import AutoTokenizer

    recipes = recipes or ZOOS[model]
    names = list(only or recipes)
    unknown = [n for n in names if n not in recipes]
    if unknown:
        raise AssetUnavailable(f"no recipe for adapters {unknown} of the {model} zoo; use some of: {list(recipes)}")
    folder = zoo_dir(model)
    manifest = read_manifest(folder)
    todo = [n for n in names if not is_built(folder, n, manifest)]
    if not todo:
        return folder
    base_path = assets.prepare(model)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    manifest |= {"base_model": model, "base_path": str(base_path), "torch_threads": torch.get_num_threads()}
    for name in tqdm(todo, desc=f"zoo {model}", unit="adapter"):
        start = time.perf_counter()
        entry = train_adapter(base_path, tokenizer, recipes[name], folder / name)
        entry["build_seconds"] = round(time.perf_counter() - start, 1)
        manifest["adapters"][name] = entry
        write_manifest(folder, manifest)
        result = (f"{name}: held-out loss {entry['base_loss']:.3f} -> {entry['adapter_loss']:.3f} "
                  f"({entry['train_seconds']:.0f} s training)")
        if entry["adapter_loss"] < entry["base_loss"]:
            log.info(result)
        else:
            log.warning("%s  WARNING: did not specialise", result)
    return folder


# Weight-only torchao quantizations of a zoo base (the kinds hf_invisiblelora/model/quantized.py serves;
# int4 in groups of 32 inputs, which divide every zoo model's widths).
QUANTIZATIONS = {
    "int8": lambda ao, torch: ao.Int8WeightOnlyConfig(),
    "int4": lambda ao, torch: ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(32)),
}


def load_zoo(model: str = "smollm2", names: list[str] | None = None, dtype=None, quantize: str | None = None):
    """(peft_model, tokenizer, names): the base model (float32, or ``dtype``) with the zoo's adapters
    ``names`` (default: its built plain LoRA ones, so stock PEFT's mixed batch can be the reference;
    name DoRA and modules_to_save ones to have them) loaded side by side (PEFT keeps them in float32
    on a half-precision model). ``quantize``
    ("int8", "int4": ``QUANTIZATIONS``): the base's linear layers quantized on loading, as a user
    loads one (transformers' ``TorchAoConfig``, which leaves the embedding and output head float);
    needs torchao (the extra ``quant``)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = zoo_dir(model)
    names = names or built_adapters(model)
    if not names:
        raise AssetUnavailable(
            f"no adapters in {folder}; build them: python -m hf_invisiblelora.zoo build --model {model}"
        )
    base_path = assets.prepare(model)
    quantized = {}
    if quantize is not None:
        try:
            import torchao.quantization as ao
        except ImportError as e:
            raise AssetUnavailable(f"quantize={quantize!r} needs torchao: pip install 'hf-invisiblelora[quant]' ({e})")
        from transformers import TorchAoConfig

        quantized = dict(quantization_config=TorchAoConfig(QUANTIZATIONS[quantize](ao, torch)))
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype or torch.float32, **quantized)
    peft_model = PeftModel.from_pretrained(base, folder / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(folder / name, adapter_name=name)
    return peft_model.eval(), AutoTokenizer.from_pretrained(base_path), names


def heldout_prompts(domain: str, tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` prompts of ``length`` tokens cut from the domain's held-out text, evenly spread."""
    ids = tokenizer(corpora.load_domain(domain, seed)[1], verbose=False)["input_ids"]
    step = max(length, (len(ids) - length) // count)
    return [tokenizer.decode(ids[i : i + length]) for i in range(0, step * count, step)]


def adapter_prompts(model: str, tokenizer, adapter: str, count: int, length: int, seed: int = 0) -> list[str]:
    """``heldout_prompts`` of the domain the zoo's ``adapter`` was trained on."""
    return heldout_prompts(read_manifest(zoo_dir(model))["adapters"][adapter]["domain"], tokenizer, count, length, seed)


def mixed_prompts(model: str, tokenizer, adapters, per_adapter: int, length: int) -> tuple[list[str], list[str]]:
    """``per_adapter`` held-out prompts of each adapter's domain, and each prompt's adapter."""
    prompts, rows = [], []
    for name in adapters:
        prompts += adapter_prompts(model, tokenizer, name, per_adapter, length)
        rows += [name] * per_adapter
    return prompts, rows


def corpus_vocabulary(model: str, tokenizer, size: int) -> list[int]:
    """The ``size`` most frequent token ids in the training text of the zoo's adapters' domains: a
    draft vocabulary (``generate(..., draft_vocab=ids)``) chosen without the held-out prompts."""
    from collections import Counter

    counts = Counter()
    for entry in read_manifest(zoo_dir(model))["adapters"].values():
        counts.update(tokenizer(corpora.load_domain(entry["domain"])[0], verbose=False)["input_ids"])
    return sorted(i for i, _ in counts.most_common(size))


def _rounded(acceptance: float | None) -> float | None:
    return None if acceptance is None else round(acceptance, 4)  # None: nothing drafted


def measure_acceptance(model: str = "smollm2", prompts_per_adapter: int = 4, prompt_tokens: int = 48,
                       new_tokens: int = 32, draft_tokens: int = 4) -> dict:
    """Greedy acceptance of every adapter with ``invisible_lora=True``, on held-out prompts of its
    own domain, all adapters (DoRA and modules_to_save ones too) in ONE mixed batch; written to the
    manifest under ``acceptance``.

    ``gate="always"``: every cycle drafts K tokens, so the rate is a property of the adapter
    against the base model, not of the run-time gate's choices of when to draft."""
    import torch

    import hf_invisiblelora  # noqa: F401  (patches PEFT's generate)

    peft_model, tok, names = load_zoo(model, built_adapters(model, plain_only=False))
    prompts, rows = mixed_prompts(model, tok, names, prompts_per_adapter, prompt_tokens)
    enc = tok(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.no_grad():
        out = peft_model.generate(**enc, adapter_names=rows, invisible_lora=True, num_draft_tokens=draft_tokens,
                                  gate="always", do_sample=False, max_new_tokens=new_tokens,
                                  return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    result = {
        "prompts_per_adapter": prompts_per_adapter, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "num_draft_tokens": draft_tokens, "batch": len(rows), "seconds": round(seconds, 1),
        "overall": _rounded(out.stats.acceptance_rate),
        "per_adapter": {n: _rounded(s["acceptance"]) for n, s in out.stats.per_adapter.items()},
        "drafted_accepted": {n: [s["drafted"], s["accepted"]] for n, s in out.stats.per_adapter.items()},
    }
    folder = zoo_dir(model)
    manifest = read_manifest(folder)
    manifest["acceptance"] = result
    write_manifest(folder, manifest)
    return result


def table(manifest: dict) -> str:
    """The manifest as a Markdown table (with acceptance when it was measured)."""
    acc = manifest.get("acceptance", {}).get("per_adapter", {})
    counts = manifest.get("acceptance", {}).get("drafted_accepted", {})
    lines = ["| adapter | domain | rank | alpha | targets | rslora | held-out loss base -> adapter | train s |"
             + (" greedy acceptance (accepted/drafted) |" if acc else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if acc else "")]
    for name, e in manifest["adapters"].items():
        r = e["recipe"]
        line = (f"| {name} | {e['description']} | {r['r']} | {r['alpha']} | {r['targets']} | {r['rslora']} | "
                f"{e['base_loss']:.3f} -> {e['adapter_loss']:.3f} | {e['train_seconds']:.0f} |")
        if acc:
            drafted, accepted = counts.get(name, (None, None))
            value = acc.get(name)
            line += (" no drafts" if name in acc and value is None else
                     f" {value:.2f}" + (f" ({accepted}/{drafted})" if drafted else "") if name in acc else "") + " |"
        lines.append(line)
    return "\n".join(lines)
