"""Cheaper drafters (a restricted draft vocabulary, bfloat16 draft weights) keep the output exact."""

import pytest
import torch

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.model import walk as lora
from hf_invisiblelora.model.state import state_of
from tiny import chi_square_p, prompts, tiny_peft

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]
LENGTHS = [5, 9, 3, 7, 9, 1, 6]


def greedy(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=ROWS, do_sample=False,
                          max_new_tokens=12, **kw)


@pytest.mark.parametrize("option", [dict(draft_vocab=16), dict(draft_vocab=list(range(2, 40, 3))),
                                    dict(draft_dtype=torch.bfloat16), dict(draft_vocab=24, draft_dtype=torch.bfloat16),
                                    dict(draft_dtype=torch.int8), dict(draft_dtype=torch.int4),
                                    dict(draft_vocab=24, draft_dtype=torch.int4), dict(draft_dtype=(None, torch.int4)),
                                    dict(draft_vocab=24, draft_dtype=[torch.int8, torch.bfloat16])])
def test_greedy_output_unchanged(option):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = greedy(model, ids, mask)
    greedy(model, ids, mask, invisible_lora=True, gate="never")  # the vocabulary learns what is seen
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=3,
                 return_dict_in_generate=True, **option)
    assert torch.equal(out.sequences, ref)
    assert sum(out.stats.drafted) > 0
    assert not any("forward" in vars(m) for m in model.modules())  # nothing left installed


def test_several_drafters_each_draft_and_learn_their_own_acceptance():
    """draft_dtype=(None, torch.int4): both drafters installed; with gate="always" they take turns, and
    the gate's memory holds each one's acceptance and draft cost (what it chooses by under "auto")."""
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = greedy(model, ids, mask)
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2,
                 draft_dtype=(None, torch.int4), return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    memory = state_of(model).gate
    assert {"s", ("s", "/torch.int4")} <= set(memory.trials)
    assert {key[1][1] for key in memory.costs if key[0] == "draft"} == {"eager", "eager/torch.int4", "eager/lookup"}
    auto = greedy(model, ids, mask, invisible_lora=True, draft_dtype=(None, torch.int4))
    assert torch.equal(auto, ref)


@pytest.mark.parametrize("hooked", [False, True])
def test_lora_layers_draft_straight_from_their_base_layers(monkeypatch, hooked):
    """In a draft pass a LoRA layer is its base layer: with a low-precision drafter it calls the base
    layer's copy directly, not the LoRA layer's forward (which would only pass it on); a base layer
    with a forward hook is called as a module, so the hook runs in draft passes too."""
    from hf_invisiblelora.lora import layer as lora_layer

    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = greedy(model, ids, mask)
    seen = []
    real = lora_layer.forward
    monkeypatch.setattr(lora_layer, "forward", lambda bank, m, *a, **kw: seen.append(bank.context.drafter) or
                        real(bank, m, *a, **kw))
    hooked_layer = lora.lora_layers(model)[0].base_layer
    calls = []
    if hooked:
        hooked_layer.register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2,
                 draft_dtype=torch.int8, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.stats.draft_passes > 0
    assert seen and all(d is None for d in seen)  # LoRA-on passes only
    if hooked:  # a draft pass gives one token per row: LoRA-on passes give more (prefill, verify)
        assert sum(shape[1] == 1 for shape in calls) >= out.stats.draft_passes


def test_drafters_installed_together_keep_their_weights(monkeypatch):
    """int8 and int4 drafters in one call each make their quantized copies once: a later call reuses
    both (a shared slot per module made each evict the other, re-quantizing the model every call)."""
    from hf_invisiblelora.decode import low_precision

    made = []
    real = low_precision.low_precision_linear
    monkeypatch.setattr(low_precision, "low_precision_linear", lambda w, b, dtype: made.append(dtype) or real(w, b, dtype))
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    counts = []
    for _ in range(2):
        greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2, draft_vocab=24,
               draft_dtype=(torch.int8, torch.int4))
        counts.append((made.count(torch.int8), made.count(torch.int4)))
    linears = len(lora.linears(model))  # the base layers and the head, not the adapters' lora_A / lora_B
    # Made at each drafter's first draft pass (the head's not at all: the restricted head drafts), once.
    assert counts[0] == counts[1] and all(linears - 1 <= n <= linears for n in counts[0]), (counts, linears)


def test_restricted_drafts_stay_in_the_vocabulary():
    """Drafts come from the subset: with a vocabulary that excludes what the target says, nothing is accepted."""
    model = tiny_peft("llama", strength=0.0)  # adapters with zero B: the target is the base model
    ids, mask = prompts(LENGTHS)
    ref = greedy(model, ids, mask)
    generated = set(ref[:, ids.shape[1]:].flatten().tolist())
    others = [t for t in range(2, 64) if t not in generated]
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2, draft_vocab=others,
                 prompt_lookup=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert sum(out.stats.accepted) == 0 < sum(out.stats.drafted)
    full = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2, draft_dtype=None,
                  prompt_lookup=False, return_dict_in_generate=True)
    assert sum(full.stats.accepted) == sum(full.stats.drafted)  # the same drafter with its whole head: all accepted


@pytest.mark.parametrize("option", [dict(draft_vocab=[2, 3, 4, 5]), dict(draft_dtype=torch.int8),
                                    dict(draft_dtype=torch.int4), dict(draft_dtype=(None, torch.int4))])
def test_sampling_with_a_cheaper_drafter_is_exact(option):
    from test_sampling import PROMPT, SUPPRESS, TEMPERATURE, TOP_K, exact

    model = tiny_peft("llama", vocab=8, adapters=("b", "d"), strength=1.5, seed=1)
    with torch.no_grad():
        target = exact(model, "b")
    n = 1500
    torch.manual_seed(0)
    out = model.generate(input_ids=PROMPT.repeat(n, 1), adapter_names=["b"] * n, do_sample=True,
                         temperature=TEMPERATURE, top_k=TOP_K, suppress_tokens=SUPPRESS, max_new_tokens=3,
                         invisible_lora=True, num_draft_tokens=2, gate="always", return_dict_in_generate=True,
                         **option)
    samples = [tuple(r) for r in out.sequences[:, PROMPT.shape[1]:].tolist()]
    assert chi_square_p(samples, target) > 1e-3
    assert 0 < sum(out.stats.accepted) < sum(out.stats.drafted)


def test_token_counts_follow_calls():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts([4, 6])
    out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=["s", "b"], max_new_tokens=5,
                         do_sample=False, invisible_lora=True)
    counts = state_of(model).drafter["token_counts"]
    assert counts.sum() == out.numel() and torch.equal(counts, torch.bincount(out.flatten(), minlength=64))


@pytest.mark.parametrize("kw, message", [(dict(draft_vocab=0), "draft_vocab"), (dict(draft_vocab="many"), "draft_vocab"),
                                         (dict(draft_dtype=torch.uint8), "draft_dtype"),
                                         (dict(draft_dtype=(None, torch.uint8)), "draft_dtype"),
                                         (dict(draft_dtype=()), "distinct choices"),
                                         (dict(draft_dtype=[torch.int4, torch.int4]), "distinct choices")])
def test_bad_options(kw, message):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts([4, 6])
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids=ids, attention_mask=mask, adapter_names=["s", "b"], max_new_tokens=3,
                       invisible_lora=True, **kw)


@pytest.mark.parametrize("dtype, kernel, tolerance", [(torch.int8, "_weight_int8pack_mm", 0.02),
                                                      (torch.int4, "_weight_int4pack_mm_for_cpu", 0.15)])
def test_weight_only_drafters_run_their_kernels(monkeypatch, dtype, kernel, tolerance):
    """Weight-only int8 / int4 draft layers: close to the float layer (not equal: quantized), and
    the draft passes of a call run the kernel (so the option is not silently the full drafter)."""
    from hf_invisiblelora.decode.low_precision import low_precision_linear

    g = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(48, 64, generator=g), torch.randn(48, generator=g), torch.randn(3, 5, 64, generator=g)
    ref = torch.nn.functional.linear(x, weight, bias)
    got = low_precision_linear(weight, bias, dtype)(x)
    error = float((got - ref).abs().max() / ref.abs().max())
    assert got.shape == ref.shape and got.dtype == x.dtype and 0 < error < tolerance
    calls = []
    real = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *a: calls.append(1) or real(*a))
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2, draft_dtype=dtype,
                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy(model, ids, mask)) and calls


@pytest.mark.parametrize("dtype", [torch.int8, torch.int4])
@pytest.mark.parametrize("in_features", [4, 8, 24, 33])
def test_weight_only_kernels_only_where_their_shapes_hold(monkeypatch, dtype, in_features):
    """Layers whose widths the weight-only kernels do not take (torch 2.13's int8 kernel segfaults on
    in_features 8 or 24 with several rows: Gemma-3n's AltUp layers) draft in bfloat16 instead, the
    kernel never called."""
    from hf_invisiblelora.decode.low_precision import low_precision_linear

    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: pytest.fail("int8 kernel called"))
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", lambda *a: pytest.fail("int4 kernel called"))
    g = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(16, in_features, generator=g), torch.randn(16, generator=g), torch.randn(3, in_features)
    got = low_precision_linear(weight, bias, dtype)(x)
    expected = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()).float()
    assert torch.equal(got, expected)


def test_auto_draft_dtypes(monkeypatch):
    """draft_dtype="auto" (the default): the full model and the low-precision copies measured faster on
    this CPU (tuning.py; here int8 and int4, as if measured) where the copies fit in half the memory
    available; the full model alone where they do not."""
    from hf_invisiblelora.decode import low_precision

    measured_faster(monkeypatch, ["int8", "int4"])
    model = tiny_peft("llama", strength=0.6)
    assert low_precision.draft_dtypes("auto", model) == (None, torch.int8, torch.int4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(low_precision, "available_bytes", lambda: 1000)
        assert low_precision.draft_dtypes("auto", model) == (None,)
    with pytest.raises(ValueError, match="draft_dtype"):
        low_precision.draft_dtypes("fast", model)
    ids, mask = prompts(LENGTHS)
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy(model, ids, mask))
    assert {"s", ("s", "/torch.int8"), ("s", "/torch.int4")} <= set(state_of(model).gate.trials)  # each drafted


def measured_faster(monkeypatch, dtypes: list[str]):
    """draft_dtype="auto" as if ``dtypes`` had been measured faster than full precision (tuning.py)."""
    from hf_invisiblelora import tuning
    from hf_invisiblelora.decode import low_precision

    monkeypatch.setenv("HF_INVISIBLELORA_TUNING", "off")
    monkeypatch.setattr(tuning, "_memory", {})
    monkeypatch.setattr(low_precision, "_faster_dtypes", lambda groups: {"faster": dtypes})


def test_gate_never_makes_no_draft_copies(monkeypatch):
    """gate="never" runs no draft pass: no int8 / int4 copy of the weights is made for it (generate()
    and the engine); the default gate makes them (where measured faster)."""
    from hf_invisiblelora.engine import Engine, Request

    measured_faster(monkeypatch, ["int8", "int4"])
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    greedy(model, ids, mask, invisible_lora=True, gate="never")
    engine = Engine(model, max_batch=2, max_len=32, gate="never").start()
    try:
        engine.submit(Request(ids[0, -3:].tolist(), adapter="s", max_tokens=3)).result(60)
    finally:
        engine.stop()
    assert not state_of(model).drafter.get("weights")
    greedy(model, ids, mask, invisible_lora=True)
    assert len(state_of(model).drafter["weights"]) > 0


def test_the_gate_times_draft_passes_without_making_their_copies(monkeypatch):
    """A drafter's low-precision copies are made at its first draft pass: the gate's recorded cost of
    that pass leaves the making out (a cost with it made the gate refuse the drafter from then on)."""
    from hf_invisiblelora.decode import low_precision

    made = low_precision.low_precision_linear

    def slow(*args, **kwargs):
        import time
        time.sleep(0.05)  # a copy made slowly: 0.05 s a layer, seconds a pass
        return made(*args, **kwargs)

    monkeypatch.setattr(low_precision, "low_precision_linear", slow)
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    out = greedy(model, ids, mask, invisible_lora=True, draft_dtype=torch.int8, prompt_lookup=False)
    assert torch.equal(out, greedy(model, ids, mask))
    drafts = [t for key, window in state_of(model).gate.timings.items() if key[0] == "draft" for t in window]
    assert drafts and max(drafts) < 0.05, drafts  # every timing, the first pass's too


def _lookup_reference(row: list[int], k: int, longest: int = 3, shortest: int = 1) -> tuple[int, list[int]]:
    """prompt_lookup.match and lookup's semantics for one row, written plainly: (n matched, proposals)."""
    for n in range(longest, shortest - 1, -1):
        if len(row) <= n:
            continue
        for i in range(len(row) - n - 1, -1, -1):  # the latest earlier occurrence of the last n tokens
            if row[i : i + n] == row[-n:]:
                period = len(row) - n - i
                return n, [row[i + n + j % period] for j in range(k)]
    return 0, [row[-1]] * k


def test_lookup_proposes_what_followed_the_latest_match():
    from hf_invisiblelora.decode.prompt_lookup import lookup, match

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        rows, width, vocab = 1 + trial % 5, 24, 2 + trial % 6
        tokens = torch.randint(0, vocab, (rows, width), generator=g)
        ends = torch.randint(1, width - 4, (rows,), generator=g)
        k = 1 + trial % 4
        m = match(tokens, ends)
        got = lookup(tokens, m, k)
        for b in range(rows):
            n, proposals = _lookup_reference(tokens[b, : ends[b]].tolist(), k)
            assert (int(m.ngram[b]), got[b].tolist()) == (n, proposals), (trial, b)
    periodic = torch.tensor([[3, 1, 2, 3, 1, 2, 3, 1, 0, 0]])  # ...3 1 | 2 3 1 2: continued with its period
    assert lookup(periodic, match(periodic, torch.tensor([8])), 4).tolist() == [[2, 3, 1, 2]]


def test_lookup_acceptance_is_learned_per_match_length():
    """The gate keys the lookup drafter's acceptance by the match length of each row's proposal, and
    rows without a match teach it nothing (they proposed their last token, not a lookup)."""
    from hf_invisiblelora.decode.prompt_lookup import PromptLookupDrafter

    model = tiny_peft("llama", strength=0.6)
    base, mask = prompts(LENGTHS)
    ids = torch.cat([base, base[:, -4:], base[:, -4:]], 1)
    mask = torch.cat([mask, torch.ones(len(LENGTHS), 8, dtype=torch.long)], 1)
    greedy(model, ids, mask, invisible_lora=True, gate="auto", num_draft_tokens=3)
    keys = {key[1] for key in state_of(model).gate.trials if isinstance(key, tuple) and key[1].startswith("/lookup")}
    assert keys and keys <= {"/lookup/1", "/lookup/2", "/lookup/3"}
    from hf_invisiblelora.decode.batch import Batch

    batch = Batch.empty(2, 12, 0, "cpu")
    batch.load([0, 1], torch.tensor([[5, 6, 7, 5, 6, 7], [1, 2, 3, 4, 8, 9]]), [4, 4])
    plan = PromptLookupDrafter().plan(batch, 2)
    assert plan.labels == ["3", None]


def test_prompt_lookup_keeps_greedy_output_and_drafts():
    """Repetitive prompts: the lookup drafter's proposals are accepted where the target repeats, and
    the output is stock's; gate "always" lets the base model and lookup take turns."""
    model = tiny_peft("llama", strength=0.6)
    base, mask = prompts(LENGTHS)
    ids = torch.cat([base, base[:, -4:], base[:, -4:]], 1)  # each row's last 4 tokens, twice more
    mask = torch.cat([mask, torch.ones(len(LENGTHS), 8, dtype=torch.long)], 1)
    ref = greedy(model, ids, mask)
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=3, draft_dtype=None,
                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    memory = state_of(model).gate
    lookup_keys = [key for key in memory.trials if isinstance(key, tuple) and key[1] == "/lookup"]
    assert lookup_keys and sum(memory.accepted[key] for key in lookup_keys) > 0
    assert torch.equal(greedy(model, ids, mask, invisible_lora=True), ref)  # the gate's own choices
    assert not any("forward" in vars(m) for m in model.modules())


def test_sampling_with_prompt_lookup_is_exact(monkeypatch):
    """Lookup's proposals are point masses: a draft d is kept with probability p(d), else the token is
    drawn from p without d. The power check: keeping every proposal instead is detected."""
    from test_sampling import PROMPT, SUPPRESS, TEMPERATURE, TOP_K, exact

    from hf_invisiblelora import api
    from hf_invisiblelora.decode import acceptance, policies, prompt_lookup

    monkeypatch.setattr(api, "make_drafters", lambda *args, **kw: [prompt_lookup.PromptLookupDrafter()])
    model = tiny_peft("llama", vocab=8, adapters=("b", "d"), strength=1.5, seed=1)
    with torch.no_grad():
        target = exact(model, "b")

    def sampled(n=1500):
        torch.manual_seed(0)
        out = model.generate(input_ids=PROMPT.repeat(n, 1), adapter_names=["b"] * n, do_sample=True,
                             temperature=TEMPERATURE, top_k=TOP_K, suppress_tokens=SUPPRESS, max_new_tokens=3,
                             invisible_lora=True, num_draft_tokens=2, gate="always", return_dict_in_generate=True)
        return [tuple(r) for r in out.sequences[:, PROMPT.shape[1]:].tolist()], out.stats

    samples, stats = sampled()
    assert chi_square_p(samples, target) > 1e-3
    assert 0 < sum(stats.accepted) < sum(stats.drafted)

    def keep_all(drafts, q, scores, generator=None):
        p = acceptance.probs(scores)
        n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        return n, torch.multinomial(p[:, -1], 1, generator=generator)[:, 0]

    monkeypatch.setattr(policies, "accept_sampling", keep_all)
    assert chi_square_p(sampled()[0], target) < 1e-3



def test_an_int4_drafter_reads_the_output_head_in_int8(monkeypatch):
    """An int4 drafter's linear layers are int4 but its output head int8 (drafters.HEAD_FLOOR): the
    drafts are the head's argmax, and an int4 head cost the zoo's adapters 0.915 -> 0.79 acceptance."""
    from hf_invisiblelora.decode import low_precision

    made = []
    real = low_precision.low_precision_linear
    monkeypatch.setattr(low_precision, "low_precision_linear", lambda w, b, dtype: made.append((w, dtype)) or real(w, b, dtype))
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = greedy(model, ids, mask)
    out = greedy(model, ids, mask, invisible_lora=True, gate="always", num_draft_tokens=2, draft_dtype=torch.int4)
    head = model.get_base_model().lm_head.weight
    assert torch.equal(out, ref)
    assert [d for w, d in made if w is head] == [torch.int8]
    assert {d for w, d in made if w is not head} == {torch.int4}
