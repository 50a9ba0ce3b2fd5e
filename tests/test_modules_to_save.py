"""Adapters with modules_to_save (a whole lm_head, the norms, embed_tokens) in mixed batches: each
row goes through its adapter's copy, ``__base__`` rows and adapters without a copy through the
original, draft passes through the originals; the tokens are stock decoding's of each row alone
with its adapter (float64)."""

import types

import pytest
import torch
from peft.utils.other import ModulesToSaveWrapper

from hf_invisiblelora import api
from hf_invisiblelora.engine import Engine, Request
from hf_invisiblelora.kernels import packed_linear
from hf_invisiblelora.model import context
from hf_invisiblelora.model.state import state_of
from hf_invisiblelora.model.walk import BASE
from tiny import ADAPTERS, LINEAR, PAD, prompts, tiny_peft

SAVING = {
    "head": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    # "norm" matches every norm (model.norm and each layer's input / post-attention layernorm).
    "norms": dict(r=8, lora_alpha=8, target_modules=LINEAR, modules_to_save=["norm"]),
    "both": dict(r=2, lora_alpha=4, target_modules=["o_proj"], modules_to_save=["lm_head", "model.norm"]),
    "embed": dict(r=4, lora_alpha=8, target_modules=["up_proj"], modules_to_save=["embed_tokens"]),
}
ADAPTERS_USED = {**SAVING, "s": ADAPTERS["s"], "c": ADAPTERS["c"]}
NAMES = [*ADAPTERS_USED, BASE]


def perturb(model, seed=0, scale=0.5):
    """Move every adapter's copy away from the original (so the copies change the output): noise of
    ``scale`` times the weights' spread (their mean size where they are all alike: the norms' ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in wrappers(model):
            for copy in w.modules_to_save.values():
                for p in copy.parameters():
                    spread = p.std() if p.std() > 0 else p.abs().mean()
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * spread)
    return model


def wrappers(model):
    return [m for m in model.modules() if isinstance(m, ModulesToSaveWrapper)]


def saving_model(adapters=ADAPTERS_USED, seed=0):
    return perturb(tiny_peft("llama", adapters=adapters, strength=0.6, seed=seed), seed)


@pytest.fixture(scope="module")
def model():
    return saving_model()


def alone(model, ids, mask, rows, max_new_tokens):
    """Stock decoding of each row by itself (its real tokens, no padding) with its adapter active
    (``set_adapter``; ``disable_adapter()`` for __base__): the new tokens of each."""
    active = model.active_adapter
    out = []
    for r, name in enumerate(rows):
        x = ids[r][mask[r].bool()][None]
        kw = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens)
        if name == BASE:
            with model.disable_adapter():
                seq = model.generate(**kw)
        else:
            model.set_adapter(name)
            seq = model.generate(**kw)
        out.append(seq[0, x.shape[1]:].tolist())
    model.set_adapter(active)
    return out


def assert_as_alone(sequences, prompt_len, expected):
    """Row r's new tokens are expected[r], then padding (a row alone stops at EOS; in a batch it is padded)."""
    for r, want in enumerate(expected):
        got = sequences[r, prompt_len:].tolist()
        assert got[:len(want)] == want and all(t == PAD for t in got[len(want):]), f"row {r}: {got} vs {want}"


def invisible(model, ids, mask, rows, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, do_sample=False,
                          invisible_lora=True, return_dict_in_generate=True, **kw)


def draw(seed, n=9):
    """Rows of every kind (each saving adapter, plain LoRA, __base__) and random prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = NAMES + [NAMES[int(i)] for i in torch.randint(len(NAMES), (n - len(NAMES),), generator=g)]
    rows = [rows[int(i)] for i in torch.randperm(len(rows), generator=g)]
    lengths = torch.randint(1, 10, (len(rows),), generator=g).tolist()
    return rows, *prompts(lengths, seed=seed)


def test_the_copies_change_the_output(model):
    """Each saving adapter's copies are not the originals, and its rows decode other tokens than with
    the original modules (the same adapters unperturbed), in stock decoding itself."""
    same = tiny_peft("llama", adapters=ADAPTERS_USED, strength=0.6)
    for w in wrappers(model):
        for copy in w.modules_to_save.values():
            assert not torch.equal(copy.weight, w.original_module.weight)
    rows, ids, mask = draw(0, n=12)
    ours, unperturbed = alone(model, ids, mask, rows, 10), alone(same, ids, mask, rows, 10)
    for name in SAVING:
        assert any(a != b for a, b, row in zip(ours, unperturbed, rows) if row == name), name
    for name in (BASE, "s", "c"):  # no copy: the same tokens
        assert all(a == b for a, b, row in zip(ours, unperturbed, rows) if row == name), name


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_identical_to_each_row_alone(model, seed, k):
    rows, ids, mask = draw(seed)
    out = invisible(model, ids, mask, rows, max_new_tokens=12, num_draft_tokens=k, gate="always")
    assert_as_alone(out.sequences, ids.shape[1], alone(model, ids, mask, rows, 12))
    assert 0 < sum(out.stats.accepted) < sum(out.stats.drafted)


def test_peft_backend(model):
    rows, ids, mask = draw(3)
    out = invisible(model, ids, mask, rows, max_new_tokens=10, num_draft_tokens=2, gate="always", lora_backend="peft")
    assert_as_alone(out.sequences, ids.shape[1], alone(model, ids, mask, rows, 10))


def test_identical_to_stock_mixed_batch():
    """Where stock PEFT mixes such adapters itself (every row's adapter has a copy of every wrapped
    Linear or Embedding, and the active adapter too), its batch is ours, its logits too (from the
    LoRA-on pass over the output that output_logits takes)."""
    head = dict(SAVING["head"], modules_to_save=["lm_head", "embed_tokens"])
    model = saving_model({"h1": head, "h2": dict(head, r=8, target_modules=LINEAR)})
    rows = ["h1", "h2", BASE, "h2", "h1"]
    ids, mask = prompts([4, 7, 2, 5, 8], seed=4)
    stock = model.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, do_sample=False, max_new_tokens=12,
                           output_logits=True, return_dict_in_generate=True)
    out = invisible(model, ids, mask, rows, max_new_tokens=12, num_draft_tokens=3, gate="always", output_logits=True)
    assert torch.equal(out.sequences, stock.sequences)
    for ours, theirs in zip(out.logits, stock.logits, strict=True):
        torch.testing.assert_close(ours, theirs)


def test_draft_passes_use_the_originals(model):
    """Hooks see where each module runs: the copies only in LoRA-on passes, the originals in the
    draft passes (the rows' adapters all have copies, so no LoRA-on pass runs the originals)."""
    head, final_norm = model.base_model.model.lm_head, model.base_model.model.model.norm
    watched = {"head copy": head.modules_to_save["head"], "head original": head.original_module,
               "norm copy": final_norm.modules_to_save["both"], "norm original": final_norm.original_module}
    seen = {name: [] for name in watched}

    def hook(name):
        return lambda m, args, out: seen[name].append(context._THREAD.context.drafter is not None)
    handles = [m.register_forward_hook(hook(name)) for name, m in watched.items()]
    try:
        rows = ["head", "both", "head"]  # "head" has no copy of model.norm: its rows take the original there
        ids, mask = prompts([3, 6, 4], seed=5)
        out = invisible(model, ids, mask, rows, max_new_tokens=10, num_draft_tokens=3, gate="always")
    finally:
        for h in handles:
            h.remove()
    assert out.stats.draft_passes > 0
    assert seen["head copy"] and not any(seen["head copy"])  # never in a draft pass
    assert seen["norm copy"] and not any(seen["norm copy"])
    assert seen["head original"] and all(seen["head original"])  # only in draft passes
    assert any(seen["norm original"]) and not all(seen["norm original"])  # drafts, and the "head" rows
    assert_as_alone(out.sequences, ids.shape[1], alone(model, ids, mask, rows, 10))


def test_without_adapter_names(model):
    """Every row the model's active adapter: PEFT's own forward of the wrappers."""
    ids, mask = prompts([3, 6, 4], seed=6)
    active = model.active_adapter
    for name in SAVING:
        model.set_adapter(name)
        try:
            stock = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                                 invisible_lora=True, num_draft_tokens=2, gate="always")
        finally:
            model.set_adapter(active)
        assert torch.equal(out, stock), name


def test_disabled_adapters_use_the_originals(model):
    rows, ids, mask = draw(7)
    with model.disable_adapter():
        stock = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
        out = invisible(model, ids, mask, rows, max_new_tokens=8, num_draft_tokens=2)
    assert torch.equal(out.sequences, stock)


def test_input_not_batch_major_is_refused(model):
    """A wrapped module whose input's dim 0 is not the batch cannot be split by rows: a clear error,
    and the model is left as it was."""
    head = model.base_model.model.lm_head
    handle = head.register_forward_pre_hook(lambda m, args: (args[0].transpose(0, 1),))
    try:
        ids, mask = prompts([3, 5], seed=8)
        with pytest.raises(ValueError, match="dim 0 is not the batch"):
            invisible(model, ids, mask, ["head", "s"], max_new_tokens=4)
    finally:
        handle.remove()
    assert all("forward" not in vars(w) for w in wrappers(model))


def test_compile_refused(model):
    ids, mask = prompts([3, 5])
    with pytest.raises(ValueError, match="modules_to_save"):
        invisible(model, ids, mask, ["head", "s"], max_new_tokens=4, compile=True)


def test_auto_stays_eager(model, monkeypatch):
    """compile="auto" does not even look for compiled passes (of buckets warm_up built) for such a model."""
    monkeypatch.setattr(api, "warmed", lambda *args, **kw: pytest.fail("looked for a warmed-up bucket"))
    monkeypatch.setattr(state_of(model), "buckets", {"a bucket": types.SimpleNamespace(chosen=True)})  # warm_up's choice
    rows, ids, mask = draw(12)
    out = invisible(model, ids, mask, rows, max_new_tokens=6, compile="auto")
    assert_as_alone(out.sequences, ids.shape[1], alone(model, ids, mask, rows, 6))


def test_engine_loads_serves_and_evicts_such_adapters(tmp_path):
    """Loaded from disk while serving (PEFT adds the wrappers then), served next to plain adapters and
    the base model as each request alone, unloaded again (its copies go, the rest serves on)."""
    model = tiny_peft("llama", adapters=("s", "c"), strength=0.6)
    donor = saving_model({"both": SAVING["both"]}, seed=0)  # the same base weights (seed 0)
    donor.save_pretrained(tmp_path)
    path = tmp_path / "both" if (tmp_path / "both").exists() else tmp_path
    g = torch.Generator().manual_seed(9)
    jobs = [(torch.randint(2, 64, (1 + i % 5,), generator=g).tolist(), ["new", "s", BASE, "c"][i % 4])
            for i in range(8)]
    engine = Engine(model, max_batch=3, max_len=64, num_draft_tokens=2, gate="always").start()
    try:
        engine.load_adapter("new", str(path))
        handles = [engine.submit(Request(p, adapter=a, max_tokens=6, temperature=0)) for p, a in jobs]
        outs = [h.result(120) for h in handles]
        engine.unload_adapter("new")
        after = engine.submit(Request(jobs[1][0], adapter="s", max_tokens=6, temperature=0)).result(120)
    finally:
        engine.stop()
    assert not any(w.modules_to_save for w in wrappers(model))
    assert after == outs[1]
    engine_model = tiny_peft("llama", adapters=("s", "c"), strength=0.6)
    engine_model.load_adapter(str(path), adapter_name="new")
    engine_model.eval()
    for (prompt, name), got in zip(jobs, outs):
        ids = torch.tensor([prompt])
        assert got == alone(engine_model, ids, torch.ones_like(ids), [name], 6)[0], (prompt, name)


@pytest.mark.parametrize("options", [dict(draft_vocab=24), dict(draft_dtype=torch.bfloat16)])
def test_drafter_options(model, options):
    """The drafter's cheaper head and layers are made from the originals only (never from a copy,
    which no draft pass runs)."""
    rows, ids, mask = draw(10)
    out = invisible(model, ids, mask, rows, max_new_tokens=10, num_draft_tokens=2, gate="always", **options)
    assert_as_alone(out.sequences, ids.shape[1], alone(model, ids, mask, rows, 10))
    made = {id(m) for m in state_of(model).drafter["weights"].modules()}
    copies = {id(c) for w in wrappers(model) for copy in w.modules_to_save.values() for c in copy.modules()}
    assert made and not made & copies
    assert id(model.base_model.model.lm_head.original_module) in made


def test_prepacked_float32():
    """Float32 layers on prepacked weights (prepack.py), the copies too: as without prepacking."""
    model = saving_model()
    model.float()
    rows, ids, mask = draw(11)
    kw = dict(max_new_tokens=10, num_draft_tokens=2, gate="always")
    packed = invisible(model, ids, mask, rows, prepack=True, **kw)
    fmt = packed_linear.formats(torch.float32, torch.device("cpu"))[0]  # prepack=True: the first format
    assert state_of(model).packed.kept(model.base_model.model.lm_head.modules_to_save["head"], f"packed:{fmt}") is not None
    assert torch.equal(packed.sequences, invisible(model, ids, mask, rows, prepack=False, **kw).sequences)


def test_trainable_tokens_refused():
    model = tiny_peft("llama", adapters={"t": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                   trainable_token_indices=[3, 5])})
    ids, mask = prompts([3, 5])
    with pytest.raises(ValueError, match="trainable_token_indices"):
        invisible(model, ids, mask, ["t", BASE], max_new_tokens=4)
