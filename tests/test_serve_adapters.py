"""The subprocess server (test_serve.py's launcher and tiny float32 Llama) with adapters beyond plain
LoRA: DoRA on Linear layers, modules_to_save (a whole lm_head and the final norm, the model untied)
and embedding LoRA (embed_tokens), each loaded at start (--lora) and while serving
(/v1/load_lora_adapter). Concurrent greedy requests naming them, plain LoRA and the base model
return exactly the tokens of stock PEFT generate() of each row alone with its adapter active
(``set_adapter``; ``disable_adapter()`` for the base model), compared by token id."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from peft import PeftModel
from peft.utils.other import ModulesToSaveWrapper
from test_serve import ADAPTERS, BASE_ID, launch, request
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny import ARCHS, LINEAR, tiny_tokenizer, with_adapters

# Loaded at start (--lora), beside test_serve's plain s, b, c (which its launcher always passes).
AT_START = {
    "s": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=8, target_modules=LINEAR),
    "c": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "down_proj"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True,
                 target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
    "saved": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head", "model.norm"]),
    "emb": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "o_proj"]),
}
# Loaded while serving: the same kinds, other shapes.
AT_RUN_TIME = {
    "dora_rt": dict(r=2, lora_alpha=3, use_dora=True, use_rslora=True, target_modules="all-linear"),
    "saved_rt": dict(r=8, lora_alpha=8, target_modules=LINEAR, modules_to_save=["lm_head"]),
    "emb_rt": dict(r=2, lora_alpha=4, target_modules=["embed_tokens"]),
}
SPECIAL = [a for a in [*AT_START, *AT_RUN_TIME] if a not in ADAPTERS]
MAX_TOKENS = 8


def perturb(model, seed):
    """DoRA magnitudes moved off ||W + scaling * B @ A|| (so DoRA is not LoRA); every modules_to_save
    copy moved off the original (so the copies change the output)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for w in (m for m in model.modules() if isinstance(m, ModulesToSaveWrapper)):
            for copy in w.modules_to_save.values():
                for p in copy.parameters():
                    spread = p.std() if p.std() > 0 else p.abs().mean()
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 * spread)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The base model (saved before PEFT wraps it), the adapters given at start in adapters/, those
    loaded while serving in spare/, and a tokenizer."""
    root = tmp_path_factory.mktemp("serve_adapters")
    torch.manual_seed(0)
    base = ARCHS["llama"](64).to(torch.float32).eval()
    assert not base.config.tie_word_embeddings  # lm_head is its own module (modules_to_save copies it)
    base.save_pretrained(root / "base")
    tiny_tokenizer().save_pretrained(root / "base")
    for folder, adapters, seed in (("adapters", AT_START, 1), ("spare", AT_RUN_TIME, 2)):
        torch.manual_seed(seed)
        model = with_adapters(AutoModelForCausalLM.from_pretrained(root / "base"), adapters, strength=0.6)
        perturb(model, seed).save_pretrained(root / folder)  # one folder per adapter
    return root


@pytest.fixture(scope="module")
def reference(files):
    """Stock PEFT on the same saved files: (model with every adapter, tokenizer)."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(files / "base"), files / "adapters" / "s",
                                      adapter_name="s")
    for name in AT_START:
        if name != "s":
            model.load_adapter(files / "adapters" / name, adapter_name=name)
    for name in AT_RUN_TIME:
        model.load_adapter(files / "spare" / name, adapter_name=name)
    return model.eval(), AutoTokenizer.from_pretrained(files / "base")


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    extra = [f"--lora={name}={files / 'adapters' / name}" for name in AT_START if name not in ADAPTERS]
    with launch(files, tmp_path_factory.mktemp("serve_adapters_log") / "server.log", "--allow-runtime-lora-updating",
                *extra) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def alone(reference, ids, adapter, max_tokens=MAX_TOKENS):
    """Stock greedy generate() of one prompt with its adapter active: the new tokens up to EOS."""
    model, tok = reference
    x = torch.tensor([ids])
    if adapter != BASE_ID:
        model.set_adapter(adapter)
    with torch.no_grad(), model.disable_adapter() if adapter == BASE_ID else contextlib.nullcontext():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, len(ids):].tolist()
    return new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new


def served_tokens(client, adapter, ids, max_tokens=MAX_TOKENS):
    """The server's greedy completion as token ids (logprobs with vLLM's return_tokens_as_token_ids)."""
    r = client.completions.create(model=adapter, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    tokens = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert r.usage.completion_tokens == len(tokens)
    return tokens, r.choices[0].text


PROMPTS = [[5, 9, 17, 3], [40, 2, 33], [7, 8, 9, 10, 11, 12], [21], [60, 14, 29, 44, 2]]


def test_the_adapters_change_the_output(reference):
    """Each DoRA / modules_to_save / embedding adapter decodes other tokens than the base model on
    some prompt (stock PEFT itself), and DoRA's differ from the same LoRA weights without DoRA's
    magnitudes: the server's outputs below would tell them apart."""
    for name in SPECIAL:
        assert any(alone(reference, p, name) != alone(reference, p, BASE_ID) for p in PROMPTS), name
    model, _ = reference
    dora = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, dora.in_features)
    with torch.no_grad():
        model.set_adapter("dora")
        lora = dora.base_layer(x) + dora.lora_B["dora"](dora.lora_A["dora"](x)) * dora.scaling["dora"]
        assert (dora(x) - lora).abs().max() > 1e-3


def test_mixed_concurrent_requests_equal_each_row_alone(server, client, files, reference):
    for name in AT_RUN_TIME:
        status, body = request(server, "/v1/load_lora_adapter",
                               {"lora_name": name, "lora_path": str(files / "spare" / name)})
        assert status == 200, (name, body)
    served = [m.id for m in client.models.list().data]
    assert set(served) == {BASE_ID, *AT_START, *AT_RUN_TIME}, served
    models = [*SPECIAL, "s", "c", BASE_ID]
    jobs = [(models[i % len(models)], PROMPTS[(i + i // len(models)) % len(PROMPTS)]) for i in range(2 * len(models))]
    expected = [alone(reference, ids, name) for name, ids in jobs]
    tok = reference[1]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: served_tokens(client, *job), jobs))
    wrong = [(name, ids, want, got) for (name, ids), want, (got, _) in zip(jobs, expected, results) if got != want]
    assert not wrong, "\n".join(f"{n} {ids}: stock {want}, served {got}" for n, ids, want, got in wrong)
    for want, (_, text) in zip(expected, results):
        assert text == tok.decode(want, skip_special_tokens=True)
