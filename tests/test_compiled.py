"""Compiled passes (torch.compile on the CPU): same greedy tokens as eager, no recompiles on reuse.

Compiling costs ~10-20 s per pass even on tiny models, so these tests compile few passes: one
bucket (8 rows, 64 cache slots), K = 1 (draft, plain and 2-token verify passes).
"""

import pytest
import torch
from peft.tuners.lora.layer import LoraLayer
from torch._dynamo.utils import counters

from hf_invisiblelora import api, tuning
from hf_invisiblelora.lora.bank import get_bank
from hf_invisiblelora.model import forward as compiled
from hf_invisiblelora.model.state import state_of
from tiny import all_near_ties, divergences, prompts, tiny_peft

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]  # 7 rows: padded to a bucket of 8


def generate(model, ids, mask, names, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False,
                          max_new_tokens=10, **kw)


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def model():
    return tiny_peft("llama", strength=0.6, dtype=torch.float32)


def test_compiled_equals_eager_and_does_not_recompile(model):
    ids, mask = prompts([5, 9, 3, 7, 9, 1, 6])
    stock = generate(model, ids, mask, ROWS)
    kw = dict(invisible_lora=True, gate="always", num_draft_tokens=1, return_dict_in_generate=True)
    eager = generate(model, ids, mask, ROWS, compile=False, **kw)
    before = graphs_compiled()
    out = generate(model, ids, mask, ROWS, compile=True, **kw)
    assert graphs_compiled() - before == 3  # draft, verify (2 tokens), plain (the last, budget-capped cycle)
    assert torch.equal(out.sequences, eager.sequences)
    assert torch.equal(out.sequences, stock)
    assert out.stats.draft_passes > 0 and sum(out.stats.accepted) > 0

    # Another call in the same bucket: other prompts, lengths, adapters and batch size (5 -> 8 rows).
    ids2, mask2 = prompts([2, 8, 4, 6, 3], seed=1)
    rows2 = ["d", "d", "s", "__base__", "c"]
    before = graphs_compiled()
    out2 = generate(model, ids2, mask2, rows2, compile=True, **kw)
    assert graphs_compiled() == before, "a second call in the same bucket must not compile again"
    assert torch.equal(out2.sequences, generate(model, ids2, mask2, rows2))


def test_compiled_draft_passes_run_the_drafter(model):
    """compile=True with a drafter option: the compiled draft pass is the drafter's (its own pass,
    keyed by its options). A draft vocabulary of one token the target never emits: every draft is
    rejected; the full vocabulary: drafts are accepted. (The compiled passes used to be built
    without the drafter: its options were installed but never switched on, so drafts came from the
    whole head, while the gate recorded costs under the drafter's name.)"""
    ids, mask = prompts([5, 9, 3, 7, 9, 1, 6])
    stock = generate(model, ids, mask, ROWS)
    unseen = next(t for t in range(model.config.vocab_size) if t not in set(stock[:, ids.shape[1]:].flatten().tolist()))
    kw = dict(invisible_lora=True, gate="always", num_draft_tokens=1, return_dict_in_generate=True, compile=True,
              prompt_lookup=False)  # the base model drafts alone: its vocabulary's drafts are judged
    for vocab, accepted in (([unseen], False), (list(range(model.config.vocab_size)), True)):
        out = generate(model, ids, mask, ROWS, draft_vocab=vocab, **kw)
        assert torch.equal(out.sequences, stock)
        assert sum(out.stats.drafted) > 0 and (sum(out.stats.accepted) > 0) == accepted
    (bucket,) = [b for k, b in state_of(model).buckets.items() if k[2] == 8]
    assert {key[1] for key in bucket.passes} >= {"/vocab1", f"/vocab{model.config.vocab_size}"}
    before = graphs_compiled()
    generate(model, ids, mask, ROWS, draft_vocab=[unseen], **kw)  # another call, another drafter object
    assert graphs_compiled() == before


def test_compiled_passes_follow_adapter_changes(model):
    """The compiled graphs read the adapter bank's current tensors: rescaling an adapter takes effect."""
    ids, mask = prompts([4, 6, 5])
    names = ["s", "b", "d"]
    kw = dict(invisible_lora=True, gate="never", compile=True)
    generate(model, ids, mask, names, **kw)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and "b" in m.scaling]
    for m in layers:
        m.set_scale("b", 3.0)
    try:
        before = graphs_compiled()
        assert torch.equal(generate(model, ids, mask, names, **kw), generate(model, ids, mask, names))
        assert graphs_compiled() == before  # new stacks of the same shapes: no recompile
    finally:
        for m in layers:
            m.set_scale("b", 1.0)


def test_adapter_buckets_compile_once_each(model):
    """LoRA passes are built per adapter bucket (1, 2, 4, ... distinct adapters) and rank bucket (the
    largest rank, rounded up to a power of two): a call in another compiles its own, a call in one
    built before (other adapters, other rows) compiles nothing, every call as stock. Ranks: a 4,
    b 8, c 2."""
    ids, mask = prompts([4, 6])  # a bucket of 2 rows, which no other test here uses
    kw = dict(invisible_lora=True, gate="never", compile=True)
    seen = []
    for names in (["s", "s"], ["b", "c"], ["s", "__base__"], ["c", "b"]):
        before = graphs_compiled()
        assert torch.equal(generate(model, ids, mask, names, **kw), generate(model, ids, mask, names))
        seen.append(graphs_compiled() - before)
    assert seen == [1, 1, 0, 0], seen


@pytest.fixture
def verdict(monkeypatch, tmp_path):
    """warm_up's measurement of its compiled passes against eager ones (api.compiled_pays) run as it is,
    its verdict then forced (``verdict(True)``: compiled passes pay); the machine's verdicts kept in
    tmp_path. Yields the measurements made, each with the compiled passes that ran during it."""
    monkeypatch.setenv("HF_INVISIBLELORA_HOME", str(tmp_path))
    tuning.clear()
    made, real = [], api.compiled_pays

    def forced(pays):
        def measure(model, bucket, *args):
            runs = set()
            for key, fn in bucket.passes.items():
                bucket.passes[key] = lambda key=key, fn=fn: runs.add(key) or fn()
            measured = real(model, bucket, *args)
            made.append({**measured, "runs": runs})
            return {**measured, "compiled": pays}
        monkeypatch.setattr(api, "compiled_pays", measure)
        return made
    yield forced
    tuning.clear()


def test_warm_up_builds_every_pass_of_its_buckets(model, verdict):
    """After warm_up, calls in its buckets (other prompts, adapters of no higher rank, the gate's
    own choices) compile nothing and decode as stock."""
    from hf_invisiblelora import warm_up

    state_of(model).buckets.clear()
    before = graphs_compiled()
    made = verdict(True)
    warm_up(model, ["s", "b"], batch_size=3, max_length=20, num_draft_tokens=2)
    assert graphs_compiled() - before == 4  # draft, plain, verify of 2 and 3 tokens
    # The measurement timed calls on those compiled passes (plain steps, and drafting: every pass
    # kind) against eager ones.
    (measured,) = made
    assert {key[:2] for key in measured["runs"]} == {(1, ""), (1, None), (2, None), (3, None)}
    assert set(measured["ms"]) == {"compiled", "eager"}
    (bucket,) = state_of(model).buckets.values()
    # (tokens per row, drafter key or None for LoRA on, adapter and rank buckets): the base model's draft pass.
    assert set(bucket.passes) == {(1, "", None), (1, None, (2, 8)), (2, None, (2, 8)), (3, None, (2, 8))}
    before = graphs_compiled()
    runs = []
    for key, fn in bucket.passes.items():
        bucket.passes[key] = lambda fn=fn: runs.append(1) or fn()
    ids, mask = prompts([3, 5, 4], seed=2)
    for names, gate, compile in ((["b", "c", "b"], "always", True), (["s", "s", "c"], "auto", True),
                                 (["s", "b", "b"], "auto", "auto")):  # "auto": a warmed bucket's passes
        runs.clear()
        out = generate(model, ids, mask, names, invisible_lora=True, gate=gate, num_draft_tokens=2, compile=compile)
        assert torch.equal(out, generate(model, ids, mask, names))
        assert runs
    # "auto" outside the warmed buckets: eager, nothing compiled (5 rows: a bucket of 8; more
    # slots than warmed; a larger K, whose verify passes are not built).
    for size, new, k in ((5, 10, 2), (3, 60, 2), (3, 10, 4)):
        runs.clear()
        ids, mask = prompts([3, 5, 4, 2, 6][:size], seed=3)
        kw = dict(input_ids=ids, attention_mask=mask, adapter_names=["s"] * size, do_sample=False, max_new_tokens=new)
        assert torch.equal(model.generate(**kw, invisible_lora=True, num_draft_tokens=k), model.generate(**kw))
        assert not runs and graphs_compiled() == before


def test_auto_takes_a_longer_warmed_bucket(model, verdict):
    """A call needing fewer cache slots than warm_up's max_length runs in its bucket, compiling nothing."""
    from hf_invisiblelora import warm_up

    state_of(model).buckets.clear()
    verdict(True)
    warm_up(model, ["b"], batch_size=2, max_length=100, num_draft_tokens=1)  # a bucket of 128 slots
    (key,) = state_of(model).buckets
    assert key[2:] == (2, 128)
    before = graphs_compiled()
    ids, mask = prompts([4, 6], seed=4)
    out = generate(model, ids, mask, ["s", "c"], invisible_lora=True, num_draft_tokens=1, return_dict_in_generate=True)
    assert torch.equal(out.sequences, generate(model, ids, mask, ["s", "c"]))
    assert graphs_compiled() == before and list(state_of(model).buckets) == [key]
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1


def test_auto_stays_eager_where_warm_up_measured_eager_faster(model, verdict):
    """Where warm_up's compiled passes were not faster than eager ones, compile="auto" runs eager
    passes (the bucket is dropped), and a later process's warm_up, reading the verdict from the
    machine's file, compiles nothing."""
    from hf_invisiblelora import warm_up

    state_of(model).buckets.clear()
    made = verdict(False)
    warm_up(model, ["b"], batch_size=2, max_length=30, num_draft_tokens=1)
    assert len(made) == 1 and made[0]["runs"]
    assert not state_of(model).buckets
    before = graphs_compiled()
    ids, mask = prompts([4, 6], seed=5)
    out = generate(model, ids, mask, ["s", "b"], invisible_lora=True, num_draft_tokens=1)
    assert torch.equal(out, generate(model, ids, mask, ["s", "b"]))
    assert not state_of(model).buckets and graphs_compiled() == before
    tuning.clear()  # a new process: the verdict read from the machine's file
    counters.clear()
    warm_up(model, ["b"], batch_size=2, max_length=30, num_draft_tokens=1)
    assert len(made) == 1 and not state_of(model).buckets and graphs_compiled() == 0


def test_buckets():
    assert [compiled.adapter_bucket(n, 14) for n in (0, 1, 2, 3, 5, 8, 9, 14)] == [1, 1, 2, 4, 8, 8, 14, 14]
    assert [compiled.row_bucket(b) for b in (1, 2, 3, 5, 8, 9, 64, 65, 130)] == [1, 2, 4, 8, 8, 16, 64, 128, 192]
    assert [compiled.length_bucket(n) for n in (1, 64, 65, 1024, 1025)] == [64, 64, 128, 1024, 2048]


def test_compile_options(model):
    ids, mask = prompts([3, 4])
    for bad in ("yes", 1.5):
        with pytest.raises(ValueError, match="compile must be one of"):
            generate(model, ids, mask, ["s", "b"], invisible_lora=True, compile=bad)
    with pytest.raises(ValueError, match="lora_backend='bank'"):
        generate(model, ids, mask, ["s", "b"], invisible_lora=True, compile=True, lora_backend="peft")
    with pytest.raises(ValueError, match="only apply with invisible_lora=True"):
        generate(model, ids, mask, ["s", "b"], compile=True)
    # "auto" on the CPU with no warmed-up bucket stays eager: nothing is kept on the model.
    state_of(model).clear()
    generate(model, ids, mask, ["s", "b"], invisible_lora=True)
    assert not state_of(model).buckets
    assert get_bank(model).context is None


def test_sliding_window_model_compiled():
    """Gemma 3 (window 5, mask per layer type) through a compiled plain pass."""
    model = tiny_peft("gemma3", strength=0.6, dtype=torch.float32)
    ids, mask = prompts([5, 9, 3])
    names = ["s", "__base__", "d"]
    out = generate(model, ids, mask, names, invisible_lora=True, gate="never", compile=True)
    assert torch.equal(out, generate(model, ids, mask, names))


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compiled.backend_for("auto", cpu, torch.float32, "bank") is None  # compiling costs minutes there
    assert compiled.backend_for(True, cpu, torch.float64, "bank") == "inductor"
    assert compiled.backend_for(False, cuda, torch.bfloat16, "bank") is None
    assert compiled.backend_for("auto", cuda, torch.bfloat16, "peft") is None
    # CUDA graphs need the Triton kernels: float64 on CUDA takes the torch path, which reads sizes on the host.
    assert compiled.backend_for("auto", cuda, torch.float64, "bank") is None
    with pytest.raises(ValueError, match="CUDA graphs need the Triton kernels"):
        compiled.backend_for(True, cuda, torch.float64, "bank")
    pytest.importorskip("triton")
    assert compiled.backend_for("auto", cuda, torch.bfloat16, "bank") == "cuda_graphs"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run by benchmarks/gpu_check.sh)")


def assert_stock_or_near_ties(model, ids, mask, names, out, **kw):
    """Greedy tokens equal to stock PEFT's, or leaving them only at near ties of stock's logits (a
    GPU's matmuls round differently for other shapes; testing.divergences has the rule)."""
    ref = model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False, max_new_tokens=10,
                         output_logits=True, return_dict_in_generate=True, **kw)
    diverged = divergences(model, names, ref, out, mask, ids.shape[1])
    assert all_near_ties(diverged), f"divergences (step, gap, stock's noise) not at near ties: {diverged}"
    return diverged


@cuda
@pytest.mark.parametrize("k", [1, 4])
def test_cuda_graphs_equal_eager_and_stock(k):
    model = tiny_peft("llama", strength=0.6, dtype=torch.float32).cuda()
    ids, mask = (t.cuda() for t in prompts([5, 9, 3, 7, 9, 1, 6]))
    kw = dict(invisible_lora=True, gate="always", num_draft_tokens=k)
    eager = generate(model, ids, mask, ROWS, compile=False, **kw)
    captured = generate(model, ids, mask, ROWS, compile=True, **kw)  # first call: captures the graphs
    replayed = generate(model, ids, mask, ROWS, compile=True, **kw)
    for out in (eager, captured, replayed):
        assert_stock_or_near_ties(model, ids, mask, ROWS, out)
    assert torch.equal(captured, replayed)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_graphs_half_precision(dtype):
    """A half-precision model with PEFT's float32 adapters (autocast_adapter_dtype), through the
    Triton kernels and CUDA graphs."""
    model = tiny_peft("llama", strength=0.6, dtype=dtype).cuda()
    assert next(p for n, p in model.named_parameters() if "lora_A" in n).dtype == torch.float32
    ids, mask = (t.cuda() for t in prompts([5, 9, 3, 7, 9, 1, 6]))
    out = generate(model, ids, mask, ROWS, invisible_lora=True, gate="always", num_draft_tokens=2, compile=True)
    assert_stock_or_near_ties(model, ids, mask, ROWS, out)


@cuda
def test_cuda_graphs_second_call_and_adapter_changes():
    """The captured graphs of a bucket serve a later call with other rows, adapters and batch size
    (their metadata buffers are refreshed); a rescaled adapter is seen without recapture (its slots
    are rewritten in place); a replaced adapter (deleted, added again) makes the bank rebuild and the
    stacks follow it (rebuilt, and the graphs recaptured, when its slot order changes)."""
    from peft import LoraConfig

    from tiny import ADAPTERS

    model = tiny_peft("llama", strength=0.6, dtype=torch.float32).cuda()
    kw = dict(invisible_lora=True, gate="always", num_draft_tokens=2, compile=True)
    ids, mask = (t.cuda() for t in prompts([5, 9, 3, 7, 9, 1, 6]))
    assert_stock_or_near_ties(model, ids, mask, ROWS, generate(model, ids, mask, ROWS, **kw))
    ids2, mask2 = (t.cuda() for t in prompts([2, 8, 4, 6, 3], seed=1))
    rows2 = ["d", "d", "s", "__base__", "c"]
    assert_stock_or_near_ties(model, ids2, mask2, rows2, generate(model, ids2, mask2, rows2, **kw))

    version = get_bank(model).version
    for m in model.modules():
        if isinstance(m, LoraLayer) and "d" in m.scaling:
            m.set_scale("d", 2.5)
    assert_stock_or_near_ties(model, ids2, mask2, rows2, generate(model, ids2, mask2, rows2, **kw))
    assert get_bank(model).version == version  # rewritten in place: the graphs still hold the stacks

    model.delete_adapter("d")
    model.add_adapter("d", LoraConfig(init_lora_weights=False, **ADAPTERS["d"]))
    model.to("cuda").eval()
    assert_stock_or_near_ties(model, ids2, mask2, rows2, generate(model, ids2, mask2, rows2, **kw))
