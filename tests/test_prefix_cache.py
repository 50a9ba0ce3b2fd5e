"""Automatic prefix caching in the engine (engine/prefix_cache.py): a request whose prompt starts with
blocks an earlier request's prefill left prefills only the rest, and answers exactly as standalone
generate() (float64, greedy), in the sweeps of the bug class other servers have had: keys and
values computed under one adapter, revision or base weights read for another."""

import logging
import time

import pytest
import torch
from peft.utils.other import ModulesToSaveWrapper

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora.engine import Engine, Request
from hf_invisiblelora.engine.prefix_cache import BLOCK, PrefixCache, Revisions
from hf_invisiblelora.engine.request import Status
from tiny import LINEAR, tiny_peft

ADAPTERS = ["s", "b", "c", "__base__"]


def reference(model, prompt, adapter, max_tokens):
    """Stock decoding of one prompt under one adapter (set_adapter: DoRA and modules_to_save adapters too)."""
    ids = torch.tensor([prompt])
    if adapter == "__base__":
        with model.disable_adapter():
            out = model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False)
    else:
        active = model.active_adapter
        model.set_adapter(adapter)
        try:
            out = model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False)
        finally:
            model.set_adapter(active)
    return out[0, len(prompt):].tolist()


def tokens(g, n, vocab=64):
    return torch.randint(2, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_peft("llama", strength=0.6)


def run(engine, jobs, max_tokens=6):
    """Each (prompt, adapter) submitted after the last is done; [(answer, prompt tokens the cache gave it)]."""
    out = []
    for prompt, adapter in jobs:
        before = engine.metrics_snapshot()["prefix_hits"]
        answer = engine.submit(Request(prompt, adapter=adapter, max_tokens=max_tokens, temperature=0)).result(60)
        out.append((answer, engine.metrics_snapshot()["prefix_hits"] - before))
    return out


def test_a_shared_prefix_is_prefilled_once_per_adapter(model):
    """The same 40-token system prompt under three adapters and the base model: each adapter's first
    request prefills it whole, its later ones take its blocks (all but the last token's at most);
    the same prompt under another adapter or the base model never does; every answer is stock's."""
    g = torch.Generator().manual_seed(0)
    system = tokens(g, 40)
    jobs = [(system + tokens(g, n), a) for n in (3, 6) for a in ADAPTERS] + [(list(system), "s"), (system[:17], "b")]
    engine = Engine(model, max_batch=2, max_len=96, num_draft_tokens=2).start()
    try:
        results = run(engine, jobs)
        m = engine.metrics_snapshot()
    finally:
        engine.stop()
    for (prompt, adapter), (answer, hit) in zip(jobs, results):
        assert answer == reference(model, prompt, adapter, 6), adapter
    hits = [hit for _, hit in results]
    assert hits[:4] == [0] * 4  # first under each adapter
    assert hits[4:8] == [2 * BLOCK] * 4  # 40 tokens: two full blocks
    assert hits[8] == 2 * BLOCK  # the system prompt alone: its last token is prefilled, so two blocks of 39
    assert hits[9] == BLOCK  # 17 tokens: the first block
    assert m["prefix_queries"] == sum(len(p) for p, _ in jobs) and m["prefix_hits"] == sum(hits)


def test_a_chat_turn_takes_the_blocks_of_the_last_turn_and_its_answer(model):
    """Turns of a chat (each prompt the conversation so far: the last prompt, its answer, a new
    message) under each adapter and the base model: a turn finds the blocks of the last one's prompt
    and answer (kept when the request ended, all of the answer but its last token), and every
    answer is stock's."""
    g = torch.Generator().manual_seed(10)
    engine = Engine(model, max_batch=2, max_len=160, num_draft_tokens=2).start()
    try:
        for adapter in ADAPTERS:
            prompt = tokens(g, 20)
            for turn in range(3):
                [(answer, hit)] = run(engine, [(prompt, adapter)], max_tokens=12)
                assert answer == reference(model, prompt, adapter, 12), (adapter, turn)
                if turn:  # the last turn's prompt and answer but its last token, in full blocks
                    assert hit == (len(last) + len(last_answer) - 1) // BLOCK * BLOCK, (adapter, turn)
                last, last_answer = prompt, answer
                prompt = prompt + answer + tokens(g, 5)
    finally:
        engine.stop()


def test_roots_follow_the_weights_not_the_names():
    """A root changes with everything the keys and values depend on, by every route a user has: the
    base weights (in place, through .data), an adapter's B, its scale, a DoRA magnitude, a
    modules_to_save copy; not with the name (the same weights under two names share blocks)."""
    configs = {"s": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
               "twin": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
               "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "down_proj"]),
               "saved": dict(r=4, lora_alpha=8, target_modules=["v_proj"], modules_to_save=["lm_head"])}
    model = tiny_peft("llama", adapters=configs, strength=0.6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".twin." in name:
                p.copy_(dict(model.named_parameters())[name.replace(".twin.", ".s.")])

    def roots():
        r = Revisions(model)
        return {a: r.root(a) for a in [*configs, "__base__"]}

    first = roots()
    assert first == roots()  # a fresh read gives the same
    assert first["s"] == first["twin"] and len({first[a] for a in ("s", "dora", "saved", "__base__")}) == 4
    layer = model.base_model.model.model.layers[0]
    edits = {
        "base weight, in place": (lambda: layer.mlp.up_proj.weight.mul_(1.01), set(first)),
        "base weight, .data": (lambda: layer.mlp.up_proj.weight.data.__setitem__((0, 0), 0.5), set(first)),
        "lora_B": (lambda: layer.self_attn.q_proj.lora_B["s"].weight.add_(0.01), {"s"}),
        "scale": (lambda: [m.set_scale("s", 0.5) for m in model.modules() if hasattr(m, "set_scale")
                           and "s" in getattr(m, "scaling", {})], {"s"}),
        "DoRA magnitude": (lambda: layer.mlp.down_proj.lora_magnitude_vector["dora"].weight.mul_(1.1), {"dora"}),
        "modules_to_save": (lambda: next(m for m in model.modules() if isinstance(m, ModulesToSaveWrapper))
                            .modules_to_save["saved"].weight.add_(0.01), {"saved"}),
    }
    for what, (edit, changed) in edits.items():
        before = roots()
        with torch.no_grad():
            edit()
        after = roots()
        assert {a for a in before if before[a] != after[a]} == changed, what


def test_an_adapter_loaded_again_with_new_weights_reads_no_old_block(tmp_path):
    """The same name unloaded and loaded again from other files: its prompt's blocks are not read
    (another root), the answer is the new weights'; the other adapters' blocks still are."""
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    for seed, folder in ((1, "old"), (2, "new")):
        tiny_peft("llama", adapters=("d",), strength=0.6, seed=seed).save_pretrained(tmp_path / folder)
    g = torch.Generator().manual_seed(1)
    system = tokens(g, 36)
    prompts = [system + tokens(g, 4) for _ in range(2)]
    engine = Engine(model, max_batch=2, max_len=96, num_draft_tokens=2).start()
    try:
        engine.load_adapter("x", str(tmp_path / "old" / "d"))
        old = run(engine, [(prompts[0], "x"), (prompts[1], "x"), (prompts[0], "s")])
        assert [h for _, h in old] == [0, 2 * BLOCK, 0]
        assert old[1][0] == reference(model, prompts[1], "x", 6)
        engine.unload_adapter("x")
        engine.load_adapter("x", str(tmp_path / "new" / "d"))
        new = run(engine, [(prompts[1], "x"), (prompts[1], "s")])
        assert new[0][1] == 0 and new[0][0] == reference(model, prompts[1], "x", 6)
        assert new[0][0] != old[1][0]
        assert new[1][1] == 2 * BLOCK and new[1][0] == reference(model, prompts[1], "s", 6)
    finally:
        engine.stop()


def test_dora_and_modules_to_save_adapters_with_cached_prefixes():
    """DoRA rows, modules_to_save rows (an lm_head and the final norm copied per adapter) and plain
    ones, each taking its own blocks: every answer is stock's under set_adapter."""
    configs = {"dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=LINEAR),
               "saved": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
               "plain": dict(r=8, lora_alpha=8, target_modules=LINEAR)}
    model = tiny_peft("llama", adapters=configs, strength=0.6)
    with torch.no_grad():  # DoRA off its initial magnitudes, the saved copy off the original
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name or "modules_to_save" in name:
                p.mul_(1.3)
    g = torch.Generator().manual_seed(2)
    system = tokens(g, 33)
    jobs = [(system + tokens(g, 2 + i), a) for i in range(2) for a in [*configs, "__base__"]]
    engine = Engine(model, max_batch=3, max_len=96, num_draft_tokens=2).start()
    try:
        results = run(engine, jobs)
    finally:
        engine.stop()
    for (prompt, adapter), (answer, _) in zip(jobs, results):
        assert answer == reference(model, prompt, adapter, 6), adapter
    assert [h for _, h in results] == [0] * 4 + [2 * BLOCK] * 4


def while_prefilling(engine, g, prompt, max_tokens):
    """(busy, handle): a request decoding in one row for as long as the engine's rows allow (so a
    prompt is prefilled a chunk a cycle), and one for ``prompt`` under "s", returned once its prompt
    is being prefilled."""
    busy = engine.submit(Request(tokens(g, 3), adapter="b", max_tokens=engine.limits.max_len - 16, temperature=0,
                                 ignore_eos=True))
    while busy.status != Status.DECODING:
        time.sleep(0.001)
    h = engine.submit(Request(prompt, adapter="s", max_tokens=max_tokens, temperature=0))
    while h.status != Status.PREFILLING:
        time.sleep(0.001)
    return busy, h


def test_a_request_cancelled_while_its_prompt_is_prefilled_leaves_no_block(model):
    """A prompt prefilled in chunks (prefill_chunk 4) whose request is cancelled halfway stores
    nothing: the next request with it prefills it whole and answers as stock."""
    g = torch.Generator().manual_seed(3)
    long = tokens(g, 120)
    engine = Engine(model, max_batch=2, max_len=160, num_draft_tokens=2, prefill_chunk=4).start()
    try:
        busy, h = while_prefilling(engine, g, long, 4)
        h.cancel()
        h.result(60)
        assert h.finish_reason == "cancelled"
        busy.cancel()
        assert engine.metrics_snapshot()["prefix_blocks"] == 0
        [(answer, hit)] = run(engine, [(long, "s")], max_tokens=4)
    finally:
        engine.stop()
    assert hit == 0 and answer == reference(model, long, "s", 4)


def test_blocks_of_a_prefill_an_adapter_change_cut_through_are_not_kept(tmp_path):
    """The base weights edited, then an adapter loaded (the engine reads the weights again at every
    adapter change), while a prompt is being prefilled in chunks: its keys and values are half old,
    so none of its blocks is kept; the same prompt afterwards prefills whole and answers as stock
    under the edited weights."""
    model = tiny_peft("llama", adapters=("s", "b"), strength=0.6)
    tiny_peft("llama", adapters=("d",), strength=0.6, seed=7).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(8)
    long = tokens(g, 200)
    engine = Engine(model, max_batch=2, max_len=256, num_draft_tokens=2, prefill_chunk=2).start()
    try:
        busy, h = while_prefilling(engine, g, long, 3)
        with torch.no_grad():
            model.base_model.model.model.layers[1].mlp.up_proj.weight.mul_(1.5)
        engine.load_adapter("d", str(tmp_path / "d"))
        assert h.status == Status.PREFILLING  # the change cut through its prefill
        h.result(60)
        busy.cancel()
        assert engine.metrics_snapshot()["prefix_blocks"] == 0
        [(answer, hit)] = run(engine, [(long, "s")], max_tokens=3)
        assert engine.metrics_snapshot()["prefix_blocks"] == len(long) // BLOCK  # now kept
    finally:
        engine.stop()
    assert hit == 0 and answer == reference(model, long, "s", 3)


def test_eviction_keeps_the_bound_and_the_answers(model):
    """A cache of three blocks: many prefixes evict each other least recently used first (a chain
    from its end), the bytes never pass the bound, and every answer is stock's, hit or not."""
    g = torch.Generator().manual_seed(4)
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    block_bytes = model.config.num_hidden_layers * 2 * heads * BLOCK * dim * 8  # float64
    prefixes = [tokens(g, 2 * BLOCK) for _ in range(3)]
    jobs = [(prefixes[i % 3] + tokens(g, 3), ADAPTERS[i % 2]) for i in range(9)]
    engine = Engine(model, max_batch=2, max_len=96, num_draft_tokens=2, prefix_cache_bytes=3 * block_bytes).start()
    try:
        results, bytes_seen = [], []
        for job in jobs:
            results += run(engine, [job])
            bytes_seen.append(engine.metrics_snapshot()["prefix_bytes"])
    finally:
        engine.stop()
    for (prompt, adapter), (answer, _) in zip(jobs, results):
        assert answer == reference(model, prompt, adapter, 6)
    assert max(bytes_seen) <= 3 * block_bytes and bytes_seen[-1] > 0


def test_concurrent_identical_prefixes(model):
    """Eight requests at once with one prefix over two adapters (2 rows: they join as rows free, some
    after the first ones stored the blocks): every answer is stock's, and the later ones hit."""
    g = torch.Generator().manual_seed(5)
    system = tokens(g, 48)
    jobs = [(system + tokens(g, 1 + i % 3), ADAPTERS[i % 2]) for i in range(8)]
    engine = Engine(model, max_batch=2, max_len=96, num_draft_tokens=2).start()
    try:
        with engine._wake:  # queued together
            handles = [engine.submit(Request(p, adapter=a, max_tokens=5, temperature=0)) for p, a in jobs]
        answers = [h.result(60) for h in handles]
        hits = engine.metrics_snapshot()["prefix_hits"]
    finally:
        engine.stop()
    assert answers == [reference(model, p, a, 5) for p, a in jobs]
    assert hits > 0


def test_prompt_logprobs_and_windowed_models_prefill_whole(model, caplog):
    """A request for its prompt's log-probabilities takes no blocks (its prefill keeps every position's)
    and gets what it gets without the cache; a model with windowed cache layers runs without the
    cache and says so at start."""
    g = torch.Generator().manual_seed(6)
    prompt = tokens(g, 40)
    engine = Engine(model, max_batch=2, max_len=96).start()
    try:
        run(engine, [(prompt, "s")])
        h = engine.submit(Request(prompt, adapter="s", max_tokens=2, temperature=0, prompt_logprobs=1))
        h.result(60)
        with_cache = h.prompt_logprobs
        assert engine.metrics_snapshot()["prefix_hits"] == 0
    finally:
        engine.stop()
    engine = Engine(model, max_batch=2, max_len=96, prefix_caching=False).start()
    try:
        h = engine.submit(Request(prompt, adapter="s", max_tokens=2, temperature=0, prompt_logprobs=1))
        h.result(60)
    finally:
        engine.stop()
    assert with_cache == h.prompt_logprobs
    windowed = tiny_peft("gemma3", strength=0.6)
    with caplog.at_level(logging.WARNING, logger="hf_invisiblelora"):
        engine = Engine(windowed, max_batch=2, max_len=96).start()
        try:
            out = run(engine, [(prompt, "s"), (prompt, "s")])
        finally:
            engine.stop()
    assert "prefix caching is off" in caplog.text
    assert [h for _, h in out] == [0, 0] and out[1][0] == reference(windowed, prompt, "s", 6)


def test_the_cache_alone():
    """PrefixCache: chains differ with the root and any token; a match stops at the first block
    missing; storing past the bound evicts from the chains' ends."""
    cache = PrefixCache(max_bytes=3 * 64)
    t = list(range(50))
    a, b = cache.chain(b"a", t), cache.chain(b"b", t)
    assert len(a) == 3 and not set(a) & set(b) and cache.chain(b"a", t[:40]) == a[:2]
    assert cache.chain(b"a", t[:15] + [99] + t[16:])[0] != a[0]
    block = lambda i: ((torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)),)  # 64 bytes
    cache.store(a[:2], block)
    assert cache.match(a) == 2 and cache.match(b) == 0
    seen = []  # what another thread reading the engine's counters would see while a store runs
    cache.store(b[:2], lambda i: (seen.append(cache.bytes), block(i))[1])
    # 4 blocks for 3: a's last one goes first (a's first is more recent); the bound held throughout
    assert max(seen + [cache.bytes]) <= 3 * 64 and cache.match(a) == 1 and cache.match(b) == 2
    big = lambda i: ((torch.zeros(64, dtype=torch.float64), torch.zeros(64, dtype=torch.float64)),)  # over the bound
    cache.store([a[2]] + cache.chain(b"c", t)[:1], lambda i: block(i) if i == 0 else big(i))
    assert cache.bytes <= 3 * 64 and cache.bytes == 64 * len(cache)  # a block too large stops the store, evicting still


def test_metrics_count_queried_and_hit_tokens(model):
    """/metrics: vLLM's prefix cache counters (queried and hit prompt tokens) and ours (blocks, bytes)."""
    pytest.importorskip("fastapi")
    from prometheus_client.parser import text_string_to_metric_families

    from hf_invisiblelora.serving.metrics import Metrics

    g = torch.Generator().manual_seed(9)
    system = tokens(g, 35)
    engine = Engine(model, max_batch=2, max_len=96).start()
    try:
        run(engine, [(system + [3], "s"), (system + [4, 5], "s")])
        samples = {s.name: s.value for f in text_string_to_metric_families(Metrics(engine, "tiny").render()[0].decode())
                   for s in f.samples}
    finally:
        engine.stop()
    assert samples["vllm:prefix_cache_queries_total"] == 36 + 37
    assert samples["vllm:prefix_cache_hits_total"] == 2 * BLOCK
    assert samples["hf_invisiblelora_prefix_cache_blocks"] == 2 and samples["hf_invisiblelora_prefix_cache_bytes"] > 0
