"""A zoo of real LoRA adapters, trained here with PEFT on distinct real text domains.

There is no hub to download public adapters from, so this recipe makes a set that looks like
them: different domains, ranks 4..64, attention-only or all-linear targets, various alpha, with
and without rsLoRA. Everything is seeded; sources are listed in ``corpora``. Adapters and a
``manifest.json`` (held-out loss on the adapter's own domain, base vs adapter, training time) go
to ``<cache>/zoo/<model>/``. Only missing adapters are trained.

    python -m hf_invisiblelora.zoo build [--model smollm2|gemma3] [--only NAME ...]
    python -m hf_invisiblelora.zoo accept [--model smollm2]   # greedy acceptance with invisible_lora
    python -m hf_invisiblelora.zoo table [--model smollm2]    # the manifest as a Markdown table
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from . import assets, corpora

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = "all-linear"  # PEFT: every nn.Linear but the output head


@dataclass(frozen=True)
class Recipe:
    """How one adapter is trained. Defaults are sized for 2 CPU cores shared with other work: one
    step of 4 x 64 tokens took ~13 s there (~1.5 s on idle cores)."""

    domain: str
    r: int
    alpha: int
    targets: str | list[str] = ALL_LINEAR
    rslora: bool = False
    steps: int = 24
    batch: int = 4
    block: int = 64
    lr: float = 1e-3
    seed: int = 0

    @property
    def targets_label(self) -> str:
        return "all-linear" if self.targets == ALL_LINEAR else "attention"


ZOOS: dict[str, dict[str, Recipe]] = {
    "smollm2": {
        "brown_news": Recipe("brown_news", r=4, alpha=8, targets=ATTENTION),
        "brown_learned": Recipe("brown_learned", r=8, alpha=16),
        "shakespeare": Recipe("shakespeare", r=16, alpha=32, targets=ATTENTION),
        "kjv": Recipe("kjv", r=8, alpha=16),
        "poetry": Recipe("poetry", r=32, alpha=32, targets=ATTENTION, rslora=True),
        "childrens_stories": Recipe("childrens_stories", r=4, alpha=4),
        "austen": Recipe("austen", r=16, alpha=16, rslora=True),
        "sotu": Recipe("sotu", r=64, alpha=64, targets=ATTENTION),
        "fortunes": Recipe("fortunes", r=8, alpha=8, targets=ATTENTION),
        "python_code": Recipe("python_code", r=16, alpha=32),
        "python_docs": Recipe("python_docs", r=32, alpha=64),
        "humaneval": Recipe("humaneval", r=8, alpha=16, targets=ATTENTION, rslora=True),
        "email": Recipe("email", r=64, alpha=16, rslora=True),
        "brown_romance": Recipe("brown_romance", r=4, alpha=16, targets=ATTENTION),
    },
    "gemma3": {
        "shakespeare": Recipe("shakespeare", r=8, alpha=16, targets=ATTENTION, steps=16),
        "kjv": Recipe("kjv", r=16, alpha=32, steps=16),
        # alpha 32 (rsLoRA scale 5.7) made Gemma's held-out loss rise (3.37 -> 3.90); scale 1.4 does not.
        "python_code": Recipe("python_code", r=32, alpha=8, rslora=True, steps=16),
        "sotu": Recipe("sotu", r=4, alpha=8, targets=ATTENTION, steps=16),
    },
}

# Held-out loss: this many blocks from the start of the held-out text (the same ones for base and adapter).
EVAL_BLOCKS = 12


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


def held_out_loss(model, blocks: list[list[int]]) -> float:
    """Mean next-token loss over equal-length blocks, one block at a time (no padding involved)."""
    import torch

    total = 0.0
    with torch.no_grad():
        for ids in blocks:
            total += model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    return total / len(blocks)


def train_adapter(base_path: Path, tokenizer, recipe: Recipe, out_dir: Path) -> dict:
    """Train one adapter from a fresh copy of the base model; return its manifest entry."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    train_text, heldout_text = corpora.load_domain(recipe.domain, seed=recipe.seed)
    # Every block starts the way the tokenizer starts any text (Gemma: <bos>, which it needs;
    # SmolLM2: nothing), followed by a window of the raw token stream.
    prefix = tokenizer("")["input_ids"]
    span = recipe.block - len(prefix)
    train_ids = tokenizer(train_text, add_special_tokens=False, verbose=False)["input_ids"]
    heldout_ids = tokenizer(heldout_text, add_special_tokens=False, verbose=False)["input_ids"]
    blocks = [prefix + b for b in corpora.eval_blocks(heldout_ids, span, EVAL_BLOCKS)]

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model.eval()
    base_loss = held_out_loss(model, blocks)
    config = LoraConfig(r=recipe.r, lora_alpha=recipe.alpha, target_modules=recipe.targets,
                        use_rslora=recipe.rslora, lora_dropout=0.05, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=recipe.lr, weight_decay=0.0)
    rng = random.Random(recipe.seed)
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(recipe.steps), desc=recipe.domain, unit="step", leave=False)
    for _ in bar:
        batch = torch.tensor([prefix + b for b in corpora.sample_blocks(train_ids, span, recipe.batch, rng)])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    train_seconds = time.perf_counter() - start
    model.eval()
    adapter_loss = held_out_loss(model, blocks)
    model.save_pretrained(out_dir)
    return {
        "domain": recipe.domain,
        "description": corpora.DOMAINS[recipe.domain].description,
        "source": corpora.DOMAINS[recipe.domain].source,
        "recipe": asdict(recipe) | {"targets": recipe.targets_label},
        "trainable_params": sum(p.numel() for p in trainable),
        "heldout_tokens": sum(map(len, blocks)),
        "base_loss": round(base_loss, 4),
        "adapter_loss": round(adapter_loss, 4),
        "train_seconds": round(train_seconds, 1),
    }


def build(model: str = "smollm2", only: list[str] | None = None, recipes: dict[str, Recipe] | None = None) -> Path:
    """Train the zoo's missing adapters (or only the named ones); return the zoo folder."""
    import torch
    from transformers import AutoTokenizer

    recipes = recipes or ZOOS[model]
    names = list(only or recipes)
    unknown = [n for n in names if n not in recipes]
    if unknown:
        raise SystemExit(f"unknown adapters for {model}: {unknown}; known: {list(recipes)}")
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
        verdict = "" if entry["adapter_loss"] < entry["base_loss"] else "  WARNING: did not specialise"
        tqdm.write(f"{name}: held-out loss {entry['base_loss']:.3f} -> {entry['adapter_loss']:.3f} "
                   f"({entry['train_seconds']:.0f} s training){verdict}")
    return folder


def load_zoo(model: str = "smollm2", names: list[str] | None = None, dtype=None):
    """(peft_model, tokenizer, names): the base model (float32, or ``dtype``) with the zoo's adapters
    loaded side by side (PEFT keeps them in float32 on a half-precision model)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = zoo_dir(model)
    manifest = read_manifest(folder)
    names = names or [n for n in manifest["adapters"] if is_built(folder, n, manifest)]
    if not names:
        raise SystemExit(f"no adapters in {folder}; run: python -m hf_invisiblelora.zoo build --model {model}")
    base_path = assets.prepare(model)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype or torch.float32)
    peft_model = PeftModel.from_pretrained(base, folder / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(folder / name, adapter_name=name)
    return peft_model.eval(), AutoTokenizer.from_pretrained(base_path), names


def heldout_prompts(domain: str, tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` prompts of ``length`` tokens cut from the domain's held-out text, evenly spread."""
    ids = tokenizer(corpora.load_domain(domain, seed)[1], verbose=False)["input_ids"]
    step = max(length, (len(ids) - length) // count)
    return [tokenizer.decode(ids[i : i + length]) for i in range(0, step * count, step)]


def measure_acceptance(model: str = "smollm2", prompts_per_adapter: int = 4, prompt_tokens: int = 48,
                       new_tokens: int = 32, draft_tokens: int = 4) -> dict:
    """Greedy acceptance of every adapter with ``invisible_lora=True``, on held-out prompts of its
    own domain, all adapters in ONE mixed batch; written to the manifest under ``acceptance``.

    ``gate="always"``: every cycle drafts K tokens, so the rate is a property of the adapter
    against the base model, not of the run-time gate's choices of when to draft."""
    import torch

    import hf_invisiblelora  # noqa: F401  (patches PEFT's generate)

    peft_model, tok, names = load_zoo(model)
    prompts, rows = [], []
    for name in names:
        domain = read_manifest(zoo_dir(model))["adapters"][name]["domain"]
        prompts += heldout_prompts(domain, tok, prompts_per_adapter, prompt_tokens)
        rows += [name] * prompts_per_adapter
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
        "overall": round(out.stats.acceptance_rate, 4),
        "per_adapter": {n: round(s["acceptance"], 4) for n, s in out.stats.per_adapter.items()},
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
            line += (f" {acc[name]:.2f}" + (f" ({accepted}/{drafted})" if drafted else "") if name in acc else "") + " |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_invisiblelora.zoo", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("build", "accept", "table"):
        p = sub.add_parser(cmd)
        p.add_argument("--model", default="smollm2", choices=sorted(ZOOS))
        if cmd == "build":
            p.add_argument("--only", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            folder = build(args.model, args.only)
            print(table(read_manifest(folder)))
            print(f"manifest: {folder / 'manifest.json'}")
        elif args.cmd == "accept":
            print(json.dumps(measure_acceptance(args.model), indent=2))
        else:
            print(table(read_manifest(zoo_dir(args.model))))
    except assets.AssetError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
