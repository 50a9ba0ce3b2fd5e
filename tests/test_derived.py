"""Derived copies follow their source (hf_invisiblelora/model/derived.py), by every route of change.

For each kind of copy (prepacked weights, DoRA column scales, the bank's stacks, low-bit draft
weights and a restricted draft head), each of its sources is changed by each route users take
(in-place ops, ``.data`` writes that keep every row's values, ``load_state_dict``, a replaced
parameter, a NumPy view, PEFT's merge / unmerge, an MLP's neurons permuted, ``model.to`` and back),
after a warm call made the copies; the next call then decodes as stock does on the edited model
(float64 exactly; float32 prepacked layers up to near ties of stock's logits), and a drafter's
copies are those of the new values (a stale drafter would only lose acceptance: its copies are
compared directly). Processors that leave a restricted draft vocabulary no mass: the drafter
proposes nothing there, greedy output and the sampled distribution are stock's.
"""

import pytest
import torch
from test_dora_embedding import DORA, alone, assert_rows_equal, build

import hf_invisiblelora  # noqa: F401  (generate(..., invisible_lora=True))
from hf_invisiblelora.decode.low_precision import low_precision_linear
from hf_invisiblelora.kernels import packed_linear
from hf_invisiblelora.model import derived
from hf_invisiblelora.model.state import state_of
from hf_invisiblelora.model.walk import linears
from tiny import PAD, all_near_ties, chi_square_p, divergences, prompts, tiny_peft

ROWS = ["s", "b", "__base__", "c", "d", "b"]
DORA_ROWS = ["d1", "p", "__base__", "d2", "d1"]
LENGTHS = [5, 9, 3, 7, 9, 2]
NEW = 8


# --- the routes: each changes a tensor of the model after a warm call --------------------------------


def owner(model, w):
    """(module, attribute) holding parameter ``w``, and its name in the state dict."""
    for name, m in model.named_modules():
        for leaf, p in m._parameters.items():
            if p is w:
                return m, leaf, f"{name}.{leaf}" if name else leaf
    raise LookupError("not a parameter of the model")


def in_place(model, w):
    with torch.no_grad():
        w.mul_(-1.25)


def data_element(model, w):
    w.data.view(-1)[0] += 0.5  # .data: no version counter bumped


def data_permuted(model, w):
    w.data.copy_(w.data.flip(-1))  # each row keeps its values (and their sum): the columns permuted


def data_rows_permuted(model, w):
    w.data.copy_(w.data.roll(1, 0))


def data_reassigned(model, w):
    w.data = w.data.flip(-1).contiguous()  # a new storage under the same parameter


def numpy_view(model, w):
    w.detach().numpy()[..., :3] *= -1  # a NumPy view of its memory: PyTorch sees nothing


def loaded(model, w):
    name = owner(model, w)[2]
    model.load_state_dict({name: torch.flip(w.detach(), [-1]) * 0.75}, strict=False)


def replaced(model, w):
    m, leaf, _ = owner(model, w)
    setattr(m, leaf, torch.nn.Parameter(torch.flip(w.detach(), [-1]), requires_grad=w.requires_grad))


ROUTES = [in_place, data_element, data_permuted, data_rows_permuted, data_reassigned, numpy_view, loaded, replaced]


def merged_and_unmerged(model):
    """PEFT's merge and unmerge: the base weights come back rounded (not the same bits)."""
    model.merge_adapter()
    model.unmerge_adapter()


def neurons_permuted(model):
    """Layer 0's MLP neurons permuted, as model-merging alignment does: gate / up rows with down columns."""
    mlp = model.get_base_model().model.layers[0].mlp
    perm = torch.randperm(mlp.gate_proj.get_base_layer().out_features, generator=torch.Generator().manual_seed(0))
    for proj, axis in ((mlp.gate_proj, 0), (mlp.up_proj, 0), (mlp.down_proj, 1)):
        w = proj.get_base_layer().weight
        w.data.copy_(w.data.index_select(axis, perm))


def to_and_back(model):
    """The whole model through bfloat16 and back: every tensor rounded, same dtype after."""
    dtype = model.get_base_model().dtype
    model.to(torch.bfloat16).to(dtype)


MODEL_ROUTES = [merged_and_unmerged, neurons_permuted, to_and_back]
ALL_ROUTES = [(r, s) for r in ROUTES for s in ("first", "second")] + [(r, None) for r in MODEL_ROUTES]
IDS = [f"{r.__name__}-{s}" if s else r.__name__ for r, s in ALL_ROUTES]


def change(model, route, sources, which):
    """Apply ``route`` to the model (a model route) or to one of ``sources(model)``."""
    if which is None:
        route(model)
    else:
        route(model, sources(model)[0 if which == "first" else 1])


def generate(model, ids, mask, names, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False,
                          max_new_tokens=NEW, pad_token_id=PAD, **kw)


# --- prepacked weights (float32: oneDNN packs float32) ----------------------------------------------


def packed_sources(model):
    layer = model.get_base_model().model.layers[0]
    return [layer.mlp.down_proj.base_layer.weight, model.get_base_model().lm_head.weight]


@pytest.mark.skipif(not packed_linear.available(torch.float32, torch.device("cpu")), reason="no oneDNN")
@pytest.mark.parametrize("route, which", ALL_ROUTES, ids=IDS)
def test_prepacked_weights_follow(route, which):
    model = tiny_peft("llama", strength=0.6, dtype=torch.float32)
    ids, mask = prompts(LENGTHS)
    generate(model, ids, mask, ROWS, invisible_lora=True, gate="always", num_draft_tokens=2, prepack=True)
    change(model, route, packed_sources, which)
    stock = generate(model, ids, mask, ROWS, output_logits=True, return_dict_in_generate=True)
    ours = generate(model, ids, mask, ROWS, invisible_lora=True, gate="always", num_draft_tokens=2, prepack=True)
    diverged = divergences(model, ROWS, stock, ours, mask, ids.shape[1])
    assert all_near_ties(diverged), diverged
    for m in model.modules():  # every copy is of its layer's weight as it is now
        copy = state_of(model).packed.kept(m, f"packed:{packed_linear.formats(torch.float32, 'cpu')[0]}")
        if copy is not None:
            x = torch.randn(3, m.in_features)
            torch.testing.assert_close(packed_linear.linear(x, copy, None), x @ m.weight.T, rtol=1e-5, atol=1e-5)


# --- DoRA column scales (float64; reference: each row alone under set_adapter) ---------------------


def dora_sources(model):
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    return [q.base_layer.weight, q.lora_magnitude_vector["d1"].weight]


def each_alone(model, ids, mask, names):
    """Stock generate() of each row alone under set_adapter, with its logits."""
    return alone(model, names, lambda row: model.generate(
        input_ids=ids[row:row + 1], attention_mask=mask[row:row + 1], do_sample=False, max_new_tokens=NEW,
        pad_token_id=PAD, output_logits=True, return_dict_in_generate=True))


def assert_as_alone(ours, ref, atol):
    """Tokens as each row alone, and the first step's logits (each row's prefill) within ``atol``."""
    for row, r in enumerate(ref):
        torch.testing.assert_close(ours.logits[0][row], r.logits[0][0], rtol=0, atol=atol)
    assert_rows_equal(ours.sequences, [r.sequences[0] for r in ref])


@pytest.mark.parametrize("route, which", ALL_ROUTES, ids=IDS)
def test_dora_scales_follow(route, which):
    model = build(DORA)
    ids, mask = prompts([4, 7, 2, 6, 5])
    generate(model, ids, mask, DORA_ROWS, invisible_lora=True)
    change(model, route, dora_sources, which)
    ours = generate(model, ids, mask, DORA_ROWS, invisible_lora=True, gate="always", num_draft_tokens=2,
                    output_logits=True, return_dict_in_generate=True)
    assert_as_alone(ours, each_alone(model, ids, mask, DORA_ROWS), atol=1e-10)


# --- the bank's stacks (float64; reference: stock PEFT's mixed batch) -------------------------------


def lora_sources(model):
    q = model.get_base_model().model.layers[0].self_attn.q_proj
    return [q.lora_A["b"].weight, q.lora_B["s"].weight]


@pytest.mark.parametrize("route, which", ALL_ROUTES + [("set_scale", None)], ids=IDS + ["set_scale"])
def test_bank_stacks_follow(route, which):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    generate(model, ids, mask, ROWS, invisible_lora=True)
    if route == "set_scale":
        for m in model.modules():
            if hasattr(m, "set_scale") and "s" in getattr(m, "scaling", {}):
                m.set_scale("s", 1.7)
    else:
        change(model, route, lora_sources, which)
    assert torch.equal(generate(model, ids, mask, ROWS, invisible_lora=True, gate="always", num_draft_tokens=2),
                       generate(model, ids, mask, ROWS))


# --- a drafter's low-bit weights and restricted head (float64: the output is exact whatever the
# drafter proposes, so its copies are compared with copies made afresh) -------------------------------

VOCAB = list(range(2, 40))


def draft_sources(model):
    return [model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
            model.get_base_model().lm_head.weight]


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
@pytest.mark.parametrize("route, which", ALL_ROUTES, ids=IDS)
def test_draft_copies_follow(route, which, dtype):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    options = dict(invisible_lora=True, gate="always", num_draft_tokens=2, draft_dtype=dtype, draft_vocab=VOCAB)
    generate(model, ids, mask, ROWS, **options)
    change(model, route, draft_sources, which)
    assert torch.equal(generate(model, ids, mask, ROWS, **options), generate(model, ids, mask, ROWS))
    copies = state_of(model).drafter["weights"]
    checked, layers = 0, linears(model)
    for m in layers:
        kept = copies.kept(m, ("dtype", dtype))
        if kept is not None:
            x = torch.randn(3, m.in_features, dtype=model.dtype)
            assert torch.equal(kept(x), low_precision_linear(m.weight, m.bias, dtype)(x))
            checked += 1
    head = model.get_base_model().lm_head
    # 7 per layer; the head drafts through its restricted copy (below), so none of its own is made
    assert checked == len(layers) - 1 == 14 and copies.kept(head, ("dtype", dtype)) is None
    w, _ = copies.kept(head, ("vocab", dtype))
    assert torch.equal(w, head.weight[VOCAB].to(torch.bfloat16))


# --- quantize_ after a warm call ----------------------------------------------------------------------


def test_quantized_after_a_warm_call():
    """torchao's quantize_ of the base layers after a call: the DoRA scales follow the quantized
    weights (PEFT reads them dequantized), the prepacked and draft copies of those layers are gone."""
    ao = pytest.importorskip("torchao.quantization")
    model = build(DORA).float()
    ids, mask = prompts([4, 7, 2, 6, 5])
    kw = dict(invisible_lora=True, gate="always", num_draft_tokens=2, prepack=True, draft_dtype=torch.int8,
              output_logits=True, return_dict_in_generate=True)
    generate(model, ids, mask, DORA_ROWS, **kw)
    ao.quantize_(model, ao.Int8WeightOnlyConfig(),
                 filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and "lora_" not in fqn and "lm_head" not in fqn)
    assert_as_alone(generate(model, ids, mask, DORA_ROWS, **kw), each_alone(model, ids, mask, DORA_ROWS), atol=2e-5)
    quantized = [m for m in model.modules() if type(getattr(m, "weight", None)).__name__ == "Int8Tensor"]
    kinds = [f"packed:{fmt}" for fmt in packed_linear.formats(torch.float32, torch.device("cpu"))]
    assert quantized and not any(state_of(model).packed.kept(m, kind) is not None for m in quantized for kind in kinds)


# --- the digests themselves -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int8, torch.bool])
@pytest.mark.parametrize("device_path", [False, True])
def test_digest_sees_every_change(dtype, device_path, monkeypatch):
    """One element changed by one bit, two elements swapped, rows swapped: another digest; the same
    values in another tensor: the same digest. ``device_path``: the hash used off the CPU."""
    if device_path:
        monkeypatch.setattr(derived, "_digest_bits", lambda t: derived._weighted_sum(t.detach().contiguous()))
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 2, (6, 10), generator=g).to(dtype) if dtype == torch.bool else \
        (torch.randn(6, 10, generator=g) * 50).to(dtype)
    same = derived.digest(base.clone())
    assert derived.digest(base) == same
    for edit in ("bit", "swap", "rows", "transpose"):
        t = base.clone()
        if edit == "bit":
            bits = t.view(-1).view(torch.uint8)
            bits[5] ^= 1
        elif edit == "swap":
            t[2, 3], t[2, 7] = base[2, 7], base[2, 3]
            if torch.equal(t, base):
                continue
        elif edit == "rows":
            t = t.roll(1, 0)
        else:
            t = t.T.contiguous().view(6, 10)
        assert derived.digest(t) != same, edit
    assert derived.digest(base.view(3, 20)) != same  # another shape
    assert derived.digest(1.5) == derived.digest(1.5) and derived.digest(float("nan")) == derived.digest(float("nan"))


def test_a_check_reads_each_tensor_once(monkeypatch):
    calls = []
    real = derived._digest_bits
    monkeypatch.setattr(derived, "_digest_bits", lambda t: calls.append(t.shape) or real(t))
    w = torch.randn(4, 4)
    check = derived.SourceCheck()
    assert check((w, w, 2.0)) == check((w,)) + check((w, 2.0))
    assert len(calls) == 1
    w.data[0, 0] += 1
    assert check((w,)) != derived.SourceCheck()((w,))  # a check is one moment: a new one reads again


def test_prefetch_gives_the_digests_a_check_reads(monkeypatch):
    """Digests made on torch's threads at once (SourceCheck.prefetch) are those a check makes one by
    one, each tensor read once (a tensor listed twice too), and a new check still sees a change."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, 8, generator=g) for n in (5, 7, 9, 11, 2)] + [torch.randint(0, 9, (6,), generator=g)]
    reads = []
    real = derived._digest_bits
    monkeypatch.setattr(derived, "_digest_bits", lambda t: reads.append(t.data_ptr()) or real(t))
    check = derived.SourceCheck()
    check.prefetch([*ws, ws[0], None, 2.0])
    assert sorted(reads) == sorted(w.data_ptr() for w in ws)
    assert check(tuple(ws)) == derived.SourceCheck()(tuple(ws))
    assert len(reads) == 2 * len(ws)  # the prefetched check read nothing again; the fresh one read each once
    ws[3].data[1, 1] += 1
    check2 = derived.SourceCheck()
    check2.prefetch(ws)
    assert check2((ws[3],)) != check((ws[3],)) and check2((ws[0],)) == check((ws[0],))


# --- processors that leave the draft vocabulary no mass --------------------------------------------------

SMALL, PROMPT = 16, torch.tensor([[5, 2, 7, 3]])
DRAFT_VOCAB = [5, 2, 7, 3, 9]


def banned(context):
    """The tokens the processors below leave no mass: pad, EOS, the draft vocabulary (bad words), and
    every token already in the sequence (no_repeat_ngram_size=1)."""
    return {0, 1, *DRAFT_VOCAB, *context}


def exact(model, adapter, steps):
    """P(first ``steps`` tokens) under those processors, temperature 0.7, by enumeration."""
    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in out.items():
            ids = torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long).reshape(1, -1)], 1)
            with torch.no_grad():
                s = model(input_ids=ids, adapter_names=[adapter]).logits[0, -1].clone()
            s[list(banned(ids[0].tolist()))] = -float("inf")
            probs = (s / 0.7).softmax(-1)
            for t in probs.nonzero()[:, 0].tolist():
                nxt[prefix + (t,)] = p * float(probs[t])
        out = nxt
    return out


def emptying(**kw):
    return dict(bad_words_ids=[[t] for t in DRAFT_VOCAB], suppress_tokens=[0, 1], no_repeat_ngram_size=1,
                draft_vocab=DRAFT_VOCAB, invisible_lora=True, gate="always", num_draft_tokens=2, **kw)


def test_emptied_draft_vocabulary_greedy():
    model = tiny_peft("llama", vocab=SMALL, adapters=("b", "d"), strength=1.5, seed=1)
    ids = PROMPT.repeat(3, 1)
    ref = model.generate(input_ids=ids, adapter_names=["b", "d", "__base__"], do_sample=False, max_new_tokens=4,
                         bad_words_ids=[[t] for t in DRAFT_VOCAB], suppress_tokens=[0, 1], no_repeat_ngram_size=1)
    out = model.generate(input_ids=ids, adapter_names=["b", "d", "__base__"], do_sample=False, max_new_tokens=4,
                         return_dict_in_generate=True, **emptying())
    assert torch.equal(out.sequences, ref)
    assert sum(out.stats.drafted) > 0 and sum(out.stats.accepted) == 0


def test_emptied_draft_vocabulary_sampling():
    """Every draft position's scores are all -inf (bad words cover the draft vocabulary); the call
    samples from stock's distribution (chi-square against enumeration), and the test has power: the
    same samples are far from the distribution without the processors' bans."""
    model = tiny_peft("llama", vocab=SMALL, adapters=("b", "d"), strength=1.5, seed=1)
    n, steps = 3000, 3
    torch.manual_seed(0)
    out = model.generate(input_ids=PROMPT.repeat(n, 1), adapter_names=["b"] * n, do_sample=True, temperature=0.7,
                         max_new_tokens=steps, return_dict_in_generate=True, **emptying())
    samples = [tuple(r) for r in out.sequences[:, PROMPT.shape[1]:].tolist()]
    assert chi_square_p(samples, exact(model, "b", steps)) > 1e-3
    assert sum(out.stats.drafted) > 0 and sum(out.stats.accepted) == 0  # the drafter proposed nothing
    # Power: without no_repeat_ngram_size tokens repeat, which the target distribution rules out.
    free = model.generate(input_ids=PROMPT.repeat(n, 1), adapter_names=["b"] * n, do_sample=True, temperature=0.7,
                          max_new_tokens=steps, bad_words_ids=[[t] for t in DRAFT_VOCAB], suppress_tokens=[0, 1])
    free = [tuple(r) for r in free[:, PROMPT.shape[1]:].tolist()]
    assert chi_square_p(free, exact(model, "b", steps)) < 1e-6


def test_no_repeat_ngram_empties_the_drafts_only():
    """no_repeat_ngram_size=1 with the draft vocabulary already in the prompt: the target keeps
    tokens outside it; every draft position is empty; the greedy output is stock's."""
    model = tiny_peft("llama", vocab=SMALL, adapters=("b",), strength=1.5, seed=2)
    ids = PROMPT.repeat(2, 1)
    kw = dict(do_sample=False, max_new_tokens=5, no_repeat_ngram_size=1)
    ref = model.generate(input_ids=ids, adapter_names=["b", "__base__"], **kw)
    out = model.generate(input_ids=ids, adapter_names=["b", "__base__"], invisible_lora=True, gate="always",
                         draft_vocab=PROMPT[0].tolist(), **kw)
    assert torch.equal(out, ref)
