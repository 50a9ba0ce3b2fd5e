"""Configurations users build that once decoded differently from standard generate(): each decodes
exactly as stock PEFT does (float64, greedy), or is refused before anything changes."""

import threading

import pytest
import torch
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.model.walk import lora_layers
from tiny import ADAPTERS, COMMON, PAD, prompts, tiny_peft, with_adapters

ROWS = ["s", "b", "__base__", "c", "d", "s", "b"]
LENGTHS = [5, 9, 3, 7, 9, 1, 6]


def wrap(base, adapters=("s", "b", "c", "d"), strength=0.6, seed=0, **extra):
    """PEFT adapters (testing.ADAPTERS, random B) on ``base`` in float64; ``extra`` overrides their LoraConfig."""
    torch.manual_seed(seed)
    return with_adapters(base.double().eval(), {n: {**ADAPTERS[n], **extra} for n in adapters}, strength)


def stock(model, ids, mask, names=ROWS, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False, **kw)


def ours(model, ids, mask, names=ROWS, **kw):
    kw.setdefault("gate", "always" if kw.get("num_draft_tokens", 4) else "never")
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, do_sample=False,
                          invisible_lora=True, **kw)


def assert_same_as_stock(model, ids, mask, names=ROWS, ks=(1, 3), **kw):
    """Stock output, and ours equal to it with K drafts per cycle for each K in ``ks`` (0: no drafting)."""
    ref = stock(model, ids, mask, names, **kw)
    for k in ks:
        out = ours(model, ids, mask, names, num_draft_tokens=k, **kw)
        assert torch.equal(out, ref), f"K={k}: {out.tolist()} != {ref.tolist()}"
    return ref


# 1. A sliding window on a config without layer_types (Mistral-style): every layer slides.
def test_sliding_window_without_layer_types():
    torch.manual_seed(0)
    model = wrap(MistralForCausalLM(MistralConfig(vocab_size=64, sliding_window=4, **COMMON)))
    ids, mask = prompts(LENGTHS)
    ref = assert_same_as_stock(model, ids, mask, max_new_tokens=14)
    # The window matters: without it the output is different.
    model.base_model.model.config.sliding_window = None
    assert not torch.equal(stock(model, ids, mask, max_new_tokens=14), ref)


# 2. Rotary embeddings whose frequencies depend on the sequence length.
def test_phi3_longrope_crossing_the_original_length():
    head = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    rope = dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0 + 0.1 * i for i in range(head // 2)], long_factor=[3.0 + 0.5 * i for i in range(head // 2)])
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=64, max_position_embeddings=64, original_max_position_embeddings=12, rope_parameters=rope,
                        **{k: v for k, v in COMMON.items() if k != "intermediate_size"}, intermediate_size=64)
    model = _phi3_peft(Phi3ForCausalLM(config))
    ids, mask = prompts([5, 9, 3, 7])
    names = ["p", "q", "__base__", "p"]
    # Rows cross position 12 at different cycles (the longest prompt is 9 tokens).
    ref = assert_same_as_stock(model, ids, mask, names, max_new_tokens=12, ks=(0, 1, 3))
    rotary = model.base_model.model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, rotary.long_inv_freq.double())  # left as standard decoding leaves it
    # The long factors matter: with the switch point moved past the output, stock decodes otherwise.
    model.base_model.model.config.rope_parameters["original_max_position_embeddings"] = 64
    assert not torch.equal(stock(model, ids, mask, names, max_new_tokens=12), ref)


def _phi3_peft(base):
    torch.manual_seed(1)
    return with_adapters(base.double().eval(), {"p": dict(r=4, target_modules=["qkv_proj", "o_proj"]),
                                                "q": dict(r=8, target_modules=["gate_up_proj", "down_proj"])}, 0.6)


def test_llama_dynamic_ntk():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, max_position_embeddings=10,
                         rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), **COMMON)
    model = wrap(LlamaForCausalLM(config))
    ids, mask = prompts(LENGTHS)
    rotary = model.base_model.model.model.rotary_emb
    ref = stock(model, ids, mask, max_new_tokens=12)
    state = rotary.max_seq_len_cached, rotary.inv_freq.clone()
    for k in (2, 4):
        rotary.max_seq_len_cached, rotary.inv_freq = 10, rotary.original_inv_freq.clone()
        assert torch.equal(ours(model, ids, mask, max_new_tokens=12, num_draft_tokens=k), ref)
        assert rotary.max_seq_len_cached == state[0] and torch.equal(rotary.inv_freq, state[1])


# 3. Masks that are not pure left padding.
@pytest.mark.parametrize("kind", ["right", "hole", "left_and_hole"])
def test_masks_other_than_left_padding(kind):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts([6, 6, 6, 6])
    if kind == "right":
        mask[1, 4:] = 0
        mask[3, 2:] = 0
    elif kind == "hole":
        mask[0, 2] = 0
        mask[2, 1:3] = 0
    else:
        ids, mask = prompts([4, 6, 5, 3])
        mask[1, 3] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    assert_same_as_stock(model, ids, mask, ["s", "b", "__base__", "d"], max_new_tokens=10)


# 4. Explicit position_ids are used (learned positions make them visible).
def test_explicit_position_ids_on_learned_positions():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      pad_token_id=PAD, eos_token_id=1, bos_token_id=None))
    model = wrap(gpt2, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    ids, mask = prompts([5, 9, 3, 7])
    names = ["s", "b", "__base__", "c"]
    positions = (torch.arange(9) + 7).expand(4, 9).clone()
    ref = assert_same_as_stock(model, ids, mask, names, max_new_tokens=10, position_ids=positions)
    assert not torch.equal(ref, stock(model, ids, mask, names, max_new_tokens=10))


# Learned positions when prompt + max_new_tokens reaches the model's limit: drafts of rows that
# are ahead must not read past the position table.
def test_learned_positions_up_to_the_limit():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=20,
                                      pad_token_id=PAD, eos_token_id=None, bos_token_id=None))
    model = wrap(gpt2, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    ids, mask = prompts([5, 9, 3, 7])
    assert_same_as_stock(model, ids, mask, ["s", "b", "__base__", "c"], max_new_tokens=11, ks=(1, 4))


# 5. Processors and criteria see the batch index and length standard decoding shows them.
def test_prefix_allowed_tokens_fn_gets_the_batch_id():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    allowed = {b: list(range(2 + 3 * b, 2 + 3 * b + 20)) for b in range(len(LENGTHS))}
    assert_same_as_stock(model, ids, mask, max_new_tokens=10, prefix_allowed_tokens_fn=lambda b, sent: allowed[b])


class StopAtLength(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.length)


def test_criterion_on_the_sequence_length():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    crit = StoppingCriteriaList([StopAtLength(ids.shape[1] + 6)])
    ref = assert_same_as_stock(model, ids, mask, max_new_tokens=12, stopping_criteria=crit)
    assert ref.shape[1] == ids.shape[1] + 6


class StopRowsAtLengths(StoppingCriteria):
    """Stops row r once the sequence has ``lengths[r]`` tokens."""

    def __init__(self, lengths):
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[-1] >= self.lengths


def test_stopped_rows_keep_generating_without_eos():
    """No EOS token: standard decoding keeps generating real tokens for a row a criterion stopped,
    until every row has stopped."""
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    kw = dict(max_new_tokens=12, eos_token_id=None, pad_token_id=PAD)
    free = stock(model, ids, mask, **kw)
    stops = [ids.shape[1] + n for n in (3, 7, 2, 9, 5, 4, 6)]
    ref = assert_same_as_stock(model, ids, mask, stopping_criteria=StoppingCriteriaList([StopRowsAtLengths(stops)]), **kw)
    assert torch.equal(ref, free[:, : max(stops)])  # stopped rows went on as if nothing had stopped them


# 6. Adapter weights edited by any route are seen by the next call.
@pytest.mark.parametrize("route", ["data_mul", "data_assign", "load_state_dict", "optimizer", "set_scale"])
def test_adapter_changes_are_seen(route):
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ours(model, ids, mask, max_new_tokens=4)  # builds the bank
    layers = [m for m in lora_layers(model) if "b" in m.lora_B]
    with torch.no_grad():
        if route == "data_mul":
            for m in layers:
                m.lora_B["b"].weight.data.mul_(-2.0)
        elif route == "data_assign":
            for m in layers:
                m.lora_A["b"].weight.data = torch.randn_like(m.lora_A["b"].weight)
        elif route == "load_state_dict":
            sd = get_peft_model_state_dict(model, adapter_name="b")
            set_peft_model_state_dict(model, {k: -v for k, v in sd.items()}, adapter_name="b")
        elif route == "set_scale":
            for m in layers:
                m.set_scale("b", 2.5)
    if route == "optimizer":
        params = [m.lora_B["b"].weight for m in layers]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.SGD(params, lr=5.0)
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        opt.step()
    assert_same_as_stock(model, ids, mask, max_new_tokens=8)


def test_an_adapter_edited_while_unused_is_seen_when_used():
    """A call compares only the adapters its rows use with the bank's copy: an adapter edited
    between calls that did not use it is compared (and rewritten) by the first call that does."""
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    without_b = [a if a != "b" else "c" for a in ROWS]
    ours(model, ids, mask, names=without_b, max_new_tokens=4)
    with torch.no_grad():
        for m in lora_layers(model):
            if "b" in m.lora_B:
                m.lora_B["b"].weight.data.mul_(-2.0)
    assert_same_as_stock(model, ids, mask, names=without_b, max_new_tokens=4)
    assert_same_as_stock(model, ids, mask, max_new_tokens=8)


def test_model_moved_to_another_dtype_after_a_call():
    """The bank's stacks follow model.to(...): its signature holds the adapters' dtypes and devices."""
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    assert_same_as_stock(model, ids, mask, max_new_tokens=6)
    model.to(torch.float32)
    assert_same_as_stock(model, ids, mask, max_new_tokens=6)


# 7. Threads: concurrent calls on one model give the stock output, and leave the model unchanged.
def test_concurrent_calls_on_one_model():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = stock(model, ids, mask, max_new_tokens=10)
    results, errors = [], []

    def work(i):
        try:
            if i % 3 == 2:  # a stock call meanwhile
                results.append(stock(model, ids, mask, max_new_tokens=10))
            else:
                results.append(ours(model, ids, mask, max_new_tokens=10, num_draft_tokens=1 + i % 3))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 6 and all(torch.equal(r, ref) for r in results)
    assert not any("forward" in vars(m) for m in lora_layers(model))
    assert torch.equal(stock(model, ids, mask, max_new_tokens=10), ref)


@pytest.mark.parametrize("backend", ["bank", "peft"])
def test_the_model_run_between_passes_is_the_model_as_it_is(backend):
    """Our routing acts only inside the call's passes (the pass context): a processor running the
    model on the call's own thread, between passes, gets the model's own outputs (with the bank's
    routing left on between passes, it would run the last pass's rows' adapters, or fail on its
    row count)."""
    from transformers import LogitsProcessor

    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    probe = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        expected = model(probe).logits
    seen = []

    class Probe(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(model(probe).logits)
            return scores

    out = ours(model, ids, mask, max_new_tokens=6, logits_processor=[Probe()], lora_backend=backend)
    assert torch.equal(out, stock(model, ids, mask, max_new_tokens=6))  # the probe leaves the scores as they are
    assert seen and all(torch.equal(s, expected) for s in seen)


# Crashes that must not happen.
def test_inside_inference_mode():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = stock(model, ids, mask, max_new_tokens=8)
    with torch.inference_mode():
        assert torch.equal(ours(model, ids, mask, max_new_tokens=8), ref)


def test_lora_on_lm_head():
    torch.manual_seed(0)
    model = wrap(LlamaForCausalLM(LlamaConfig(vocab_size=64, **COMMON)), adapters=("s", "b"),
                 target_modules=["q_proj", "lm_head"])
    ids, mask = prompts([5, 9, 3])
    assert_same_as_stock(model, ids, mask, ["s", "__base__", "b"], max_new_tokens=10)


def test_int32_input_ids():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    ref = stock(model, ids.int(), mask, max_new_tokens=8)
    assert torch.equal(ours(model, ids.int(), mask, max_new_tokens=8), ref)


def test_returned_cache_as_stock():
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    free = stock(model, ids, mask, max_new_tokens=10)
    eos = int(free[0, ids.shape[1] + 3])  # row 0 finishes early
    kw = dict(max_new_tokens=10, eos_token_id=eos, return_dict_in_generate=True)
    ref = model.generate(input_ids=ids, attention_mask=mask, adapter_names=ROWS, do_sample=False, **kw)
    out = ours(model, ids, mask, num_draft_tokens=3, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.cache.layers) == len(ref.cache.layers)
    for a, b in zip(out.cache.layers, ref.cache.layers):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a.values, b.values, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kw, message", [
    (dict(guidance_scale=1.5), "classifier-free guidance"),
    (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),
    (dict(dola_layers="low"), "dola generation"),
    (dict(num_beams=2), "beam search"),
])
def test_other_decoding_modes_are_refused(kw, message):
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(LENGTHS)
    with pytest.raises(ValueError, match=message):
        ours(model, ids, mask, max_new_tokens=4, **kw)
    assert not any("forward" in vars(m) for m in lora_layers(model))


def test_alibi_models_are_refused():
    torch.manual_seed(0)
    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                            alibi=True, pad_token_id=PAD, eos_token_id=1))
    model = wrap(falcon, adapters=("s",), target_modules=["query_key_value"])
    ids, mask = prompts([3, 5])
    with pytest.raises(ValueError, match="ALiBi"):
        ours(model, ids, mask, names=["s", "s"], max_new_tokens=4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_sdpa_grouped_heads_give_the_same_bits(dtype):
    """Our passes ask SDPA to read grouped KV heads in place (layout._use_gqa, within a pass context) where Transformers
    would copy them with repeat_kv: on the CPU both give the same bits, masked rows included."""
    g = torch.Generator().manual_seed(0)
    for b, heads, groups, q, n in ((16, 9, 3, 1, 128), (3, 8, 2, 4, 37), (1, 4, 1, 6, 300), (2, 6, 3, 64, 64)):
        Q = torch.randn(b, heads, q, 64, generator=g).to(dtype)
        K, V = (torch.randn(b, groups, n, 64, generator=g).to(dtype) for _ in range(2))
        mask = torch.rand(b, 1, q, n, generator=g) > 0.4
        mask[0, :, 0] = False  # a row that sees nothing (padding rows of a compiled bucket)
        rep = heads // groups
        copied = torch.nn.functional.scaled_dot_product_attention(
            Q, K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1), attn_mask=mask)
        grouped = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(grouped, copied, rtol=0, atol=0, equal_nan=True)


def test_our_passes_do_not_copy_kv_heads(monkeypatch):
    """repeat_kv runs in stock decoding of a grouped-KV model, never in ours; outputs stay equal."""
    from transformers.integrations import sdpa_attention

    calls = []
    repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(1) or repeat(*a))
    model = tiny_peft("llama", strength=0.6)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config._attn_implementation == "sdpa"
    ids, mask = prompts(LENGTHS)
    expected = stock(model, ids, mask, max_new_tokens=8)
    assert calls
    calls.clear()
    out = stock(model, ids, mask, max_new_tokens=8, invisible_lora=True, gate="always", num_draft_tokens=2)
    assert not calls
    assert torch.equal(out, expected)
