"""The zoo's training recipes (one ``Recipe`` per adapter) and the loop that trains one adapter.

There is no hub to download public adapters from, so these recipes make a set that looks like
them: different domains, ranks 4..64, attention-only or all-linear targets, various alpha, with
and without rsLoRA, DoRA, a module trained whole (``modules_to_save``). Everything is seeded; the
texts come from ``corpora``.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm  # text bars: tqdm.auto needs ipywidgets in a notebook

from . import corpora

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
    dora: bool = False
    modules_to_save: tuple[str, ...] = ()  # whole modules the adapter trains (PEFT saves its copies)
    steps: int = 24
    batch: int = 4
    block: int = 64
    lr: float = 1e-3
    seed: int = 0

    @property
    def targets_label(self) -> str:
        label = "all-linear" if self.targets == ALL_LINEAR else "attention"
        return " + ".join([label + (" (DoRA)" if self.dora else ""), *self.modules_to_save])


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
        # The kinds stock PEFT cannot put in one mixed batch with the others (DoRA) or vLLM does
        # not serve (DoRA, modules_to_save), on domains the demo's adapters already fetch.
        "kjv_dora": Recipe("kjv", r=8, alpha=16, dora=True),
        # (An adapter name must not end like a module it saves: PEFT would match its LoRA layers.)
        "shakespeare_mts": Recipe("shakespeare", r=8, alpha=16, targets=ATTENTION, modules_to_save=("model.norm",)),
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
                        use_rslora=recipe.rslora, use_dora=recipe.dora, lora_dropout=0.05, task_type="CAUSAL_LM",
                        modules_to_save=list(recipe.modules_to_save) or None)
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
