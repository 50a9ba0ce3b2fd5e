"""Continuing from a returned cache (a chat's next turn): ``generate(..., invisible_lora=True, cache=c)``
with input_ids the earlier call's sequences plus new tokens continues as standard decoding continues:
the same tokens, and ``c`` extended in place to what standard decoding leaves in it. Caches it cannot
continue exactly are refused before anything changes."""

import copy

import pytest
import torch
from test_errors import assert_unchanged, snapshot
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, QuantizedCache, StaticCache

import hf_invisiblelora  # noqa: F401  (makes generate() accept invisible_lora=True)
from tiny import ADAPTERS, COMMON, PAD, prompts, tiny_peft, with_adapters

ROWS = ["s", "b", "__base__", "c", "d", "__base__"]
VOCAB = 64


def lengths(seed: int) -> list[int]:
    """Random prompt lengths 1..9 for the rows (left-padded by ``prompts``)."""
    return torch.randint(1, 10, (len(ROWS),), generator=torch.Generator().manual_seed(seed)).tolist()


def stock(model, ids, mask, names=ROWS, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, return_dict_in_generate=True, **kw)


def ours(model, ids, mask, names=ROWS, k=3, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, return_dict_in_generate=True,
                          invisible_lora=True, num_draft_tokens=k, gate="always", **kw)


def next_turn(sequences, mask, n: int, seed: int):
    """The next turn's input: the sequences plus ``n`` new random tokens, the mask extended with ones."""
    b = sequences.shape[0]
    new = torch.randint(2, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([sequences, new], 1)
    return ids, torch.cat([mask, mask.new_ones(b, ids.shape[1] - mask.shape[1])], 1)


def assert_same_cache(a, b, tolerance=1e-9):
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers):
        assert type(x) is type(y) and x.get_seq_length() == y.get_seq_length()
        torch.testing.assert_close(x.keys, y.keys, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(x.values, y.values, rtol=tolerance, atol=tolerance)


@pytest.fixture(scope="module")
def model():
    return tiny_peft("llama", strength=0.6)


@pytest.mark.parametrize("seed, eos", [(0, False), (1, True), (2, True)])
def test_turns_continue_as_stock(model, seed, eos):
    """Three turns; the second and third continue stock from stock's cache, ours from ours, and ours from
    a copy of stock's: the same sequences, and each passed cache extended in place to stock's."""
    ids, mask = prompts(lengths(seed), seed=seed)
    kw = dict(max_new_tokens=6)
    if eos:  # row 0 stops early in the first turn: standard decoding feeds it padding, which the cache keeps
        kw.update(eos_token_id=int(stock(model, ids, mask, **kw).sequences[0, ids.shape[1] + 2]), pad_token_id=PAD)
    ref, out = stock(model, ids, mask, **kw), ours(model, ids, mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for turn in (1, 2):
        ids, mask = next_turn(ref.sequences, mask, 2 * (turn - 1), seed=10 * seed + turn)  # none: go on generating
        theirs, mine, copied = ref.cache, out.cache, copy.deepcopy(ref.cache)
        ref = stock(model, ids, mask, cache=theirs, **kw)
        out = ours(model, ids, mask, cache=mine, k=turn, **kw)
        crossed = ours(model, ids, mask, cache=copied, k=turn + 2, **kw)
        assert ref.cache is theirs and out.cache is mine and crossed.cache is copied
        assert theirs.get_seq_length() == ref.sequences.shape[1] - 1
        for o in (out, crossed):
            assert torch.equal(o.sequences, ref.sequences)
            assert_same_cache(o.cache, ref.cache)


def test_past_key_values_and_sequences_only(model):
    """The deprecated ``past_key_values=`` name, and an output of the sequences alone: the cache is
    extended in place all the same."""
    ids, mask = prompts(lengths(3), seed=3)
    first = stock(model, ids, mask, max_new_tokens=5)
    ids, mask = next_turn(first.sequences, mask, 3, seed=4)
    mine = copy.deepcopy(first.cache)
    kw = dict(input_ids=ids, attention_mask=mask, adapter_names=ROWS, do_sample=False, max_new_tokens=5)
    with pytest.warns(FutureWarning, match="past_key_values"):
        ref = model.generate(past_key_values=first.cache, **kw)
    with pytest.warns(FutureWarning, match="past_key_values"):
        out = model.generate(past_key_values=mine, invisible_lora=True, num_draft_tokens=2, gate="always", **kw)
    assert torch.equal(out, ref)
    assert_same_cache(mine, first.cache)


@pytest.mark.parametrize("arch, with_config", [("llama", False), ("llama", True), ("gemma3", True)])
def test_an_empty_cache_is_filled_in_place(arch, with_config):
    """Gemma 3's sliding-window layers too (standard decoding's keep the last window of keys)."""
    model = tiny_peft(arch, strength=0.6)
    ids, mask = prompts(lengths(5), seed=5)
    make = lambda: DynamicCache(config=model.config) if with_config else DynamicCache()  # noqa: E731
    theirs, mine = make(), make()
    ref = stock(model, ids, mask, cache=theirs, max_new_tokens=8)
    out = ours(model, ids, mask, cache=mine, max_new_tokens=8)
    assert out.cache is mine
    assert torch.equal(out.sequences, ref.sequences)
    assert_same_cache(mine, theirs)


def test_scores_and_logits_of_a_continued_call(model):
    """The processors see the whole sequence (a repetition penalty over the earlier turn too)."""
    ids, mask = prompts(lengths(6), seed=6)
    first = stock(model, ids, mask, max_new_tokens=5)
    ids, mask = next_turn(first.sequences, mask, 4, seed=7)
    kw = dict(max_new_tokens=7, repetition_penalty=1.5, output_scores=True, output_logits=True)
    mine = copy.deepcopy(first.cache)
    ref = stock(model, ids, mask, cache=first.cache, **kw)
    out = ours(model, ids, mask, cache=mine, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for name in ("scores", "logits"):
        assert len(getattr(out, name)) == len(getattr(ref, name))
        for a, b in zip(getattr(out, name), getattr(ref, name)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_same_cache(mine, first.cache)


def test_seeded_sampling_continues_as_a_fresh_call(model):
    """With one generator seed, continuing from the cache samples what the whole sequence without a cache
    samples (as standard decoding's continuation does)."""
    ids, mask = prompts(lengths(8), seed=8)
    first = ours(model, ids, mask, max_new_tokens=5)
    ids, mask = next_turn(first.sequences, mask, 3, seed=9)

    def sampled(cache):
        generator = torch.Generator().manual_seed(11)
        return ours(model, ids, mask, cache=cache, do_sample=True, top_k=10, max_new_tokens=10,
                    generator=generator).sequences

    assert torch.equal(sampled(first.cache), sampled(None))


def test_compiled_passes_continue_too():
    """compile=True (a fresh model: its compiled bucket would serve later calls): the cache is loaded into
    the bucket's (8 rows for these 6)."""
    model = tiny_peft("llama", strength=0.6)
    ids, mask = prompts(lengths(0), seed=0)
    first = stock(model, ids, mask, max_new_tokens=5)
    ids, mask = next_turn(first.sequences, mask, 3, seed=1)
    mine = copy.deepcopy(first.cache)
    ref = stock(model, ids, mask, cache=first.cache, max_new_tokens=6)
    out = ours(model, ids, mask, cache=mine, k=1, max_new_tokens=6, compile=True)
    assert torch.equal(out.sequences, ref.sequences)
    # Compiled float64 passes round apart from stock's steps by up to ~1e-7, as they do without a cache.
    assert_same_cache(mine, first.cache, tolerance=1e-6)


# Refused, before anything changes. Each case: (model maker, call kwargs maker(model, cache, ids, mask), message),
# where cache, ids and mask are a stock first turn's returned cache and the next turn's input.
def _llama():
    return tiny_peft("llama", strength=0.6)


def _dynamic_ntk():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=10,
                         rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0), **COMMON)
    return with_adapters(LlamaForCausalLM(config).double().eval(), {n: ADAPTERS[n] for n in ("s", "b", "c", "d")}, 0.6)


def _other_model_cache(model, cache, ids, mask):
    other = DynamicCache()
    for i in range(3):
        other.update(cache.layers[0].keys, cache.layers[0].values, i)
    return dict(cache=other)


def _uneven(model, cache, ids, mask):
    cache.layers[1].crop(-1)
    return dict(cache=cache)


REFUSED = {
    "static": (_llama, lambda m, c, ids, mask: dict(cache=StaticCache(config=m.config, max_cache_len=40)),
               "cannot fill a StaticCache"),
    "quantized": (_llama, lambda m, c, ids, mask: dict(cache=QuantizedCache(backend="fp8", config=m.config)),
                  "cannot fill a QuantizedCache"),
    "offloaded": (_llama, lambda m, c, ids, mask: dict(cache=DynamicCache(offloading=True)),
                  "cannot fill an offloaded DynamicCache"),
    "other_model": (_llama, _other_model_cache, r"The cache's 3 layers \(\['DynamicLayer'\]\) are not the 2 layers"),
    "sliding": (lambda: tiny_peft("gemma3", strength=0.6), lambda m, c, ids, mask: dict(cache=c),
                r"\['DynamicSlidingWindowLayer'\] layers, which keep only the last window"),
    "sliding_as_full": (lambda: tiny_peft("gemma3", strength=0.6), lambda m, c, ids, mask: dict(cache=DynamicCache()),
                        r"are not the 2 layers \(\['DynamicLayer', 'DynamicSlidingWindowLayer'\]\)"),
    "dynamic_rope": (_dynamic_ntk, lambda m, c, ids, mask: dict(cache=c), "rotary embeddings that depend on the sequence"),
    "uneven": (_llama, _uneven, "hold different numbers of tokens"),
    "num_return_sequences": (_llama, lambda m, c, ids, mask: dict(cache=c, do_sample=True, num_return_sequences=2),
                             "num_return_sequences"),
    "new_tokens_only": (_llama, lambda m, c, ids, mask: dict(cache=c, input_ids=ids[:, -3:]),
                        "input_ids must be the whole sequence"),
    "shorter_than_the_cache": (_llama, lambda m, c, ids, mask: dict(cache=c, input_ids=ids[:, :5],
                                                                           attention_mask=mask[:, :5]),
                               "a cache of 10 tokens, input_ids must be the whole sequence"),
    "dtype": (_llama, lambda m, c, ids, mask: dict(cache=DynamicCache([(x.keys.float(), x.values.float())
                                                                   for x in c.layers])),
              "computes torch.float64"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused(case):
    make_model, make_kw, message = REFUSED[case]
    model = make_model()
    ids, mask = prompts([3, 5])
    first = stock(model, ids, mask, names=["s", "b"], max_new_tokens=6)
    ids, mask = next_turn(first.sequences, mask, 3, seed=0)
    kw = dict(cache=None, input_ids=ids, attention_mask=mask)
    kw.update(make_kw(model, first.cache, ids, mask))
    cache = kw["cache"]
    held = [(x.keys.clone(), x.values.clone()) for x in getattr(cache, "layers", []) if x.keys is not None]
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        model.generate(adapter_names=["s", "b"], max_new_tokens=4, invisible_lora=True, **kw)
    assert_unchanged(model, before)
    now = [(x.keys, x.values) for x in getattr(cache, "layers", []) if x.keys is not None]
    assert len(now) == len(held) and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(now, held))
