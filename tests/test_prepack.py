"""Prepacked linear layers (prepack.py, kernels/packed_linear.py): the same matmul up to float32
rounding, routed only in our passes, and never used after their weight changed, by any route."""

import pytest
import torch

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.kernels import packed_linear
from hf_invisiblelora.model import prepack
from hf_invisiblelora.model.state import state_of
from tiny import all_near_ties, divergences, prompts, tiny_peft

pytestmark = pytest.mark.skipif(not packed_linear.available(torch.float32, torch.device("cpu")),
                                reason="this PyTorch build has no oneDNN")

ROWS = ["s", "b", "__base__", "c", "d", "s"]
LENGTHS = [5, 9, 3, 7, 9, 1]


FORMATS = packed_linear.formats(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_linear(seed, fmt):
    """Random shapes, with and without bias, 1-3 dimensional and strided inputs, 0 to 300 rows."""
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = (int(v) for v in torch.randint(1, 200, (2,), generator=g))
    w = torch.randn(out_f, in_f, generator=g)
    bias = torch.randn(out_f, generator=g) if seed % 2 else None
    packed = packed_linear.pack(w, fmt)
    sources = [t.clone() for t in (w, bias) if t is not None]
    for shape in [(in_f,), (0, in_f), (1, in_f), (7, in_f), (300, in_f), (2, 5, in_f)]:
        x = torch.randn(*shape, generator=g)
        ref = torch.nn.functional.linear(x, w, bias)
        got = packed_linear.linear(x, packed, bias)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * in_f ** 0.5)
    x = torch.randn(in_f, 6, generator=g).T  # a transposed input
    torch.testing.assert_close(packed_linear.linear(x, packed, bias), torch.nn.functional.linear(x, w, bias),
                               rtol=1e-5, atol=1e-5 * in_f ** 0.5)
    assert all(torch.equal(a, b) for a, b in zip(sources, (t for t in (w, bias) if t is not None)))  # read only


def fp32_model(seed=0):
    return tiny_peft("llama", strength=0.6, seed=seed, dtype=torch.float32)


def greedy(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=ROWS, do_sample=False, max_new_tokens=10,
                          pad_token_id=0, **kw)


def counted(monkeypatch):
    calls = []
    real = packed_linear.linear
    monkeypatch.setattr(packed_linear, "linear", lambda x, p, b: calls.append(x.shape) or real(x, p, b))
    return calls


def linears(model):
    """The base model's linear layers (not the adapters' lora_A / lora_B)."""
    names = {m: n for n, m in model.named_modules()}
    return [m for m in model.modules() if type(m) is torch.nn.Linear and ".lora_" not in names[m]]


def packed_of(model):
    """{layer: its prepacked copy} of the model's state."""
    kept = state_of(model).packed
    return {m: copy for m in model.modules() for fmt in FORMATS if (copy := kept.kept(m, f"packed:{fmt}")) is not None}


@pytest.mark.parametrize("gate", ["never", "always"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_tokens_as_stock(monkeypatch, gate, seed):
    """Every linear layer (base layers, the head) runs on its copy in our passes; the tokens are
    stock's, or leave them only at near ties of stock's float32 logits."""
    model = fp32_model(seed)
    ids, mask = prompts(LENGTHS, seed=seed)
    stock = greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True)
    calls = counted(monkeypatch)
    ours = greedy(model, ids, mask, invisible_lora=True, gate=gate, num_draft_tokens=3, prepack=True)
    assert set(packed_of(model)) == set(linears(model))
    assert len(calls) >= len(linears(model))
    assert all_near_ties(divergences(model, ROWS, stock, ours, mask, ids.shape[1]))
    assert not any("forward" in vars(m) for m in model.modules())  # nothing left installed


def test_off_and_where_it_does_not_apply(monkeypatch):
    calls = counted(monkeypatch)
    model = fp32_model()
    ids, mask = prompts(LENGTHS)
    greedy(model, ids, mask, invisible_lora=True, prepack=False)
    assert not calls and not state_of(model).packed
    model64 = tiny_peft("llama", strength=0.6)  # float64: oneDNN has no float64 matmul
    ref = greedy(model64, ids, mask)
    assert torch.equal(greedy(model64, ids, mask, invisible_lora=True, prepack=True), ref)
    assert not calls and not state_of(model64).packed


def always_faster(monkeypatch):
    """prepack="auto" measured the copies faster at every count, for every shape."""
    monkeypatch.setattr(prepack, "choices", lambda modules: {prepack._shape(m): [FORMATS[0], prepack.TOKENS] for m in modules})


def test_auto_leaves_them_out_without_the_memory(monkeypatch):
    calls = counted(monkeypatch)
    model = fp32_model()
    ids, mask = prompts(LENGTHS)
    always_faster(monkeypatch)
    monkeypatch.setattr(prepack, "available_bytes", lambda: 1000)
    greedy(model, ids, mask, invisible_lora=True)
    assert not calls and not state_of(model).packed
    monkeypatch.setattr(prepack, "available_bytes", lambda: 2**40)
    greedy(model, ids, mask, invisible_lora=True)
    assert calls and state_of(model).packed


def test_only_our_passes_use_them(monkeypatch):
    """A processor calling the model between our passes gets the layers as they are."""
    model = fp32_model()
    ids, mask = prompts(LENGTHS)
    calls = counted(monkeypatch)
    seen = []

    class Probe:
        def __call__(self, input_ids, scores):
            before = len(calls)
            model(input_ids=input_ids[:1], adapter_names=["s"])
            seen.append(len(calls) - before)
            return scores

    from transformers import LogitsProcessorList

    greedy(model, ids, mask, invisible_lora=True, gate="never", prepack=True, logits_processor=LogitsProcessorList([Probe()]))
    assert calls and seen and not any(seen)


def _edit_data(w):
    w.data[0, 0] += 0.5  # bumps no version counter


def _edit_in_place(w):
    with torch.no_grad():
        w[:, :3] *= -2


def _edit_load_state_dict(w, model):
    name = next(n for n, p in model.named_parameters() if p is w)
    state = {name: torch.randn_like(w)}
    model.load_state_dict(state, strict=False)


def _edit_replace(w, model):
    m = next(m for m in model.modules() if m._parameters.get("weight") is w)
    m.weight = torch.nn.Parameter(w.detach() * -1)


def _edit_swap_rows(w):
    w.data[[0, 1]] = w.data[[1, 0]].clone()


@pytest.mark.parametrize("edit", [_edit_data, _edit_in_place, _edit_load_state_dict, _edit_replace, _edit_swap_rows])
@pytest.mark.parametrize("layer", ["head", "base"])
def test_a_changed_weight_is_packed_again(edit, layer):
    """After any edit of a weight, the next call decodes with the edited weight: as stock does."""
    model = fp32_model()
    inner = model.get_base_model()
    ids, mask = prompts(LENGTHS)
    greedy(model, ids, mask, invisible_lora=True, prepack=True)
    m = {"head": inner.lm_head, "base": inner.model.layers[0].self_attn.q_proj.base_layer}[layer]
    before = packed_of(model)
    w = m.weight
    edit(w, model) if edit in (_edit_load_state_dict, _edit_replace) else edit(w)
    stock = greedy(model, ids, mask, output_logits=True, return_dict_in_generate=True)
    ours = greedy(model, ids, mask, invisible_lora=True, prepack=True)
    after = packed_of(model)
    assert after[m] is not before[m]
    assert sum(after[k] is before[k] for k in after) == len(after) - 1  # the others kept
    assert all_near_ties(divergences(model, ROWS, stock, ours, mask, ids.shape[1]))


def test_bad_option():
    model = fp32_model()
    ids, mask = prompts(LENGTHS)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="prepack must be"):
            greedy(model, ids, mask, invisible_lora=True, prepack=bad)


def test_engine_keeps_them_through_adapter_changes(monkeypatch, tmp_path):
    """The serving engine packs at its start and again after each adapter change (PEFT wraps the
    layers a new adapter targets); its requests decode as stock's."""
    from hf_invisiblelora.engine import Engine, Request

    model = tiny_peft("llama", adapters=("s",), strength=0.6, dtype=torch.float32)
    donor = tiny_peft("llama", adapters=("d",), strength=0.6, seed=5, dtype=torch.float32)
    donor.save_pretrained(tmp_path)
    path = tmp_path / "d" if (tmp_path / "d").exists() else tmp_path
    calls = counted(monkeypatch)
    g = torch.Generator().manual_seed(3)

    def check(engine, adapter):
        prompt = torch.randint(2, 64, (5,), generator=g).tolist()
        out = engine.submit(Request(prompt, adapter=adapter, max_tokens=8, temperature=0)).result(60)
        ids = torch.tensor([prompt])
        stock = model.generate(input_ids=ids, adapter_names=[adapter], max_new_tokens=8, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
        ours = torch.tensor([prompt + out])
        assert all_near_ties(divergences(model, [adapter], stock, ours, torch.ones_like(ids), len(prompt)))

    engine = Engine(model, max_batch=2, max_len=64, num_draft_tokens=2, gate="always", prepack=True).start()
    try:
        check(engine, "s")
        before = len(calls)
        assert before
        engine.load_adapter("new", str(path))
        check(engine, "new")
        assert len(calls) > before
        assert set(linears(model)) == set(packed_of(model))
        engine.unload_adapter("new")
        check(engine, "s")
        assert engine.error is None
    finally:
        engine.stop()


def test_auto_runs_each_copy_at_its_measured_token_counts(monkeypatch):
    """prepack="auto": a layer runs its copy for inputs whose nearest count of TOKENS at or below was
    measured faster (here 6 and 32: the six rows' steps and the prompts' pass of 34 tokens; not 8 or
    16), F.linear at the others, and layers whose copy was never faster get none; the tokens are
    stock's."""
    model = fp32_model()
    ids, mask = prompts(LENGTHS)
    stock = greedy(model, ids, mask)
    never = prepack._shape(model.get_base_model().lm_head)
    monkeypatch.setattr(prepack, "choices", lambda modules: {
        prepack._shape(m): [None, []] if prepack._shape(m) == never else [FORMATS[-1], [6, 32]] for m in modules})
    calls = counted(monkeypatch)
    ours = greedy(model, ids, mask, invisible_lora=True, gate="never")
    tokens = {shape[:-1].numel() for shape in calls}
    assert 6 in tokens and any(n >= 32 for n in tokens) and all(6 <= n < 8 or n >= 32 for n in tokens), tokens
    assert model.get_base_model().lm_head not in packed_of(model)
    assert torch.equal(ours, stock) or all_near_ties(divergences(model, ROWS, stock, ours, mask, ids.shape[1]))


def test_a_ragged_pass_chooses_by_its_real_tokens(monkeypatch):
    """In a ragged pass (rows of different query lengths: the pass context's ``real``), the copy or
    F.linear is chosen by the count of real tokens, not rows x the longest row: two rows of three
    query slots holding 3 and 1 real tokens are 4 tokens (the copy measured faster there), all 6 are
    6 (F.linear); the real tokens' outputs are F.linear's either way."""
    from hf_invisiblelora.model.context import PassContext

    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    context = PassContext(owner=lambda: True)
    route = prepack.PackedLinears._route(m, packed_linear.pack(m.weight, FORMATS[-1]), frozenset([4]), context)
    calls = counted(monkeypatch)
    x = torch.randn(2, 3, 16)
    for lens, copy in (([3, 1], True), ([3, 3], False), ([1, 1], False)):
        calls.clear()
        with torch.no_grad(), context.running(torch.zeros(2, dtype=torch.long), 3, 3, lens=torch.tensor(lens)):
            context.prepare_writes(2)
            real = context.real
            y = route(m.forward, x)
            expected = torch.nn.functional.linear(x, m.weight, m.bias)
        assert calls == ([(sum(lens), 16)] if copy else []), (lens, calls)
        torch.testing.assert_close(y[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(len(FORMATS) < 2, reason="one prepacking format in this PyTorch build")
def test_each_layer_runs_the_format_measured_for_its_shape_and_keeps_one_copy(monkeypatch):
    """prepack="auto" with the formats measured differently per shape: each layer's copy is in its
    shape's format, the tokens are stock's; measured again the other way round, every copy is made
    anew in the other format and the first ones are dropped (one copy per layer)."""
    model = fp32_model(seed=3)
    ids, mask = prompts(LENGTHS)
    stock = greedy(model, ids, mask)
    state = state_of(model)
    for flip in (0, 1):
        monkeypatch.setattr(prepack, "choices", lambda modules: {
            prepack._shape(m): [FORMATS[(m.out_features + flip) % 2], prepack.TOKENS] for m in modules})
        ours = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2)
        assert torch.equal(ours, stock) or all_near_ties(divergences(model, ROWS, stock, ours, mask, ids.shape[1]))
        layers = [m for m in linears(model) if prepack._eligible(m)]
        assert len(state.packed) == len(layers)
        for m in layers:
            fmt = FORMATS[(m.out_features + flip) % 2]
            copy = state.packed.kept(m, f"packed:{fmt}")
            assert copy is not None and isinstance(copy, packed_linear.MklPacked) == (fmt == "mkl")
            x = torch.randn(5, m.in_features)
            torch.testing.assert_close(packed_linear.linear(x, copy, m.bias), torch.nn.functional.linear(x, m.weight, m.bias),
                                       rtol=1e-5, atol=1e-5)


def test_prepacked_base_layers_run_without_their_module_call(monkeypatch):
    """In the steps run as plain functions (llama_pass.py), a LoRA layer's prepacked base layer, as
    every prepacked layer, runs through its route's direct form, not through a call of the module
    (about 210 module calls a step); the tokens are stock's."""
    from hf_invisiblelora.model import routing

    model = fp32_model()
    ids, mask = prompts(LENGTHS)
    stock = greedy(model, ids, mask)
    bases = {m.base_layer for m in model.modules() if isinstance(getattr(m, "base_layer", None), torch.nn.Linear)}
    step_calls = []  # the LoRA layers' base layers called with one token per row
    real = routing.Router._forward

    def counting(self, module):
        forward = real(self, module)

        def counted_forward(x, *args, **kwargs):
            if module in bases and x.shape[:-1] == (len(ROWS), 1):
                step_calls.append(module)
            return forward(x, *args, **kwargs)
        return counted_forward
    monkeypatch.setattr(routing.Router, "_forward", counting)
    calls = counted(monkeypatch)
    ours = greedy(model, ids, mask, invisible_lora=True, gate="never", prepack=True)
    assert bases and (len(ROWS), 1, 32) in calls and not step_calls
    assert torch.equal(ours, stock) or all_near_ties(divergences(model, ROWS, stock, ours, mask, ids.shape[1]))


def test_a_format_is_left_out_where_it_is_missing_or_computes_wrong(monkeypatch):
    """The formats are probed at import: MKL's entry points missing from this build (no library
    handle) or a result other than F.linear's leaves the format out, the others in."""
    assert "onednn" in packed_linear._probe() or "onednn" not in FORMATS
    monkeypatch.setattr(packed_linear, "_MKL", None)
    assert "mkl" not in packed_linear._probe()
    monkeypatch.undo()
    monkeypatch.setattr(packed_linear, "_mkl_linear", lambda x, packed, bias: torch.zeros(*x.shape[:-1], packed.out_features))
    assert "mkl" not in packed_linear._probe()
    monkeypatch.undo()
    assert packed_linear._probe() == FORMATS
