"""The pass context (context.py) carries per-row query lengths: a pass whose rows write different
numbers of tokens (chunked prefill next to decode tokens, ragged verification) computes what
separate passes of each row compute, and writes only each row's real tokens to the cache."""

import pytest
import torch

from hf_invisiblelora.lora.switch import BankSwitch, PeftSwitch
from hf_invisiblelora.model.forward import EagerForward
from hf_invisiblelora.model.state import state_of
from tiny import tiny_peft

NAMES = ["s", "b", "__base__"]


def keys(fwd, layer=0):
    return fwd.cache.layers[layer].keys


@pytest.mark.parametrize("switch", [BankSwitch, PeftSwitch])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ragged_pass_equals_a_pass_per_row(switch, arch):
    model = tiny_peft(arch, strength=0.6)
    inner, state = model.get_base_model(), state_of(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, inner.config.vocab_size, (len(NAMES), 12), generator=g)
    positions = torch.arange(12).expand(len(NAMES), -1)
    with state.hold(), torch.no_grad():
        forwards = []
        for _ in range(2):  # ours (ragged passes) and the reference (one pass per row)
            lora = switch(model, mixed=True)
            fwd = EagerForward(inner, lora, len(NAMES), 16, inner.device, state.mine)
            lora.set_rows(NAMES)
            fwd.layout.load(list(range(len(NAMES))), None, positions[:, :12], [11] * len(NAMES))
            forwards.append((lora, fwd))
        (lora, fwd), (ref_lora, ref) = forwards
        end = [0] * len(NAMES)
        # A prefill of uneven prompts, then steps mixing a chunk of one row with single tokens of others.
        for lens in ([5, 2, 3], [1, 4, 2], [3, 1, 1]):
            q = max(lens)
            start = torch.tensor(end)
            ids = torch.stack([tokens[r, end[r] : end[r] + q] for r in range(len(NAMES))])
            kv_len = max(e + q for e in end)
            with lora.installed(fwd.context):
                got = fwd(ids, start, kv_len, keep=1, lens=torch.tensor(lens))
            with ref_lora.installed(ref.context):
                for r, n in enumerate(lens):
                    row = torch.tensor([r])
                    want = ref(ids[r : r + 1, :n], start[row], end[r] + n, keep=1, rows=row)
                    torch.testing.assert_close(got[r], want[0], rtol=0, atol=1e-12)
            end = [e + n for e, n in zip(end, lens)]
        for r, e in enumerate(end):  # the real tokens' entries match; nothing written past them
            torch.testing.assert_close(keys(fwd)[r, :, :e], keys(ref)[r, :, :e], rtol=0, atol=1e-12)
            assert not keys(fwd)[r, :, e:].any()


def test_a_ragged_pass_computes_only_its_real_tokens(monkeypatch):
    """float32 with the prepacked linear layers (the CPU's default): the layers of a ragged pass
    compute each row's real tokens only (rows x width would pay for the padding of the widest row),
    and its logits are what a pass per row gives; the head runs at the positions kept."""
    from hf_invisiblelora.kernels import packed_linear
    from hf_invisiblelora.model.prepack import PackedLinears

    model = tiny_peft("llama", strength=0.6, dtype=torch.float32)
    inner, state = model.get_base_model(), state_of(model)
    seen, real = [], packed_linear.linear
    monkeypatch.setattr(packed_linear, "linear", lambda x, packed, bias: seen.append(x.reshape(-1, x.shape[-1]).shape[0])
                        or real(x, packed, bias))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, inner.config.vocab_size, (len(NAMES), 8), generator=g)
    lens = [6, 1, 3]
    with state.hold(), torch.no_grad():
        packed = PackedLinears(model, state, True)
        got, want = None, []
        for ragged in (True, False):
            lora = BankSwitch(model, mixed=True)
            fwd = EagerForward(inner, lora, len(NAMES), 16, inner.device, state.mine)
            lora.set_rows(NAMES)
            fwd.layout.load(list(range(len(NAMES))), None, torch.arange(8).expand(len(NAMES), -1), [11] * len(NAMES))
            with lora.installed(fwd.context), packed.installed(fwd.context):
                if ragged:
                    seen.clear()
                    got = fwd(tokens[:, :6], torch.zeros(len(NAMES), dtype=torch.long), 6, keep=1, lens=torch.tensor(lens))
                    counts = list(seen)
                else:
                    for r, n in enumerate(lens):
                        row = torch.tensor([r])
                        want.append(fwd(tokens[r : r + 1, :n], row * 0, n, keep=1, rows=row)[0])
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    assert counts[:-1] == [sum(lens)] * (len(counts) - 1)  # every layer: the 10 real tokens, not 3 x 6
    assert counts[-1] == len(NAMES) * len({n - 1 for n in lens})  # the head: the rows at positions 5, 0, 2


def _greedy_call(seed: int):
    """A tiny model, greedy generate() keywords over NAMES' rows of random prompts, and stock's tokens."""
    model = tiny_peft("llama", strength=0.6)
    ids = torch.randint(2, 64, (3, 7), generator=torch.Generator().manual_seed(seed))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=NAMES, do_sample=False,
              max_new_tokens=6, pad_token_id=0)
    return model, kw, model.generate(**kw)


@pytest.mark.parametrize("hooked", [False, True])
def test_passes_run_in_inference_mode_unless_a_hook_may_keep_their_tensors(monkeypatch, hooked):
    """Our eager passes run in inference mode (cheaper per op than no_grad) and hand out plain logits;
    a forward hook a user put on the model sees plain tensors, as under stock's generate(), so what
    it keeps can be changed in place or used with autograd later. The tokens are stock's either way."""
    from hf_invisiblelora.model import forward

    model, kw, stock = _greedy_call(seed=1)
    model.generate(**kw, output_hidden_states=True, return_dict_in_generate=True)  # Transformers' own hooks: inert
    modes, kept = [], []
    real = forward.model_pass
    monkeypatch.setattr(forward, "model_pass", lambda *a: modes.append(torch.is_inference_mode_enabled()) or real(*a))
    if hooked:
        model.get_base_model().model.layers[0].mlp.register_forward_hook(lambda m, args, out: kept.append(out))
    out = model.generate(**kw, invisible_lora=True, gate="always", num_draft_tokens=2, output_scores=True,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, stock)
    assert modes and all(m is not hooked for m in modes)
    assert not any(s.is_inference() for s in out.scores)
    out.scores[0].add_(1)  # a plain tensor: in place outside inference mode
    if hooked:
        assert kept and not any(t.is_inference() for t in kept)
        torch.nn.Linear(kept[0].shape[-1], 1, dtype=kept[0].dtype)(kept[0]).sum().backward()  # kept activations work with autograd


def test_a_call_in_the_callers_inference_mode_leaves_the_model_usable():
    """generate() inside the caller's torch.inference_mode(), as stock allows: what it leaves on the
    model (bank, draft copies and token counts) stays updatable, so a later call outside inference mode
    decodes as stock too (it raised: an in-place update of an inference tensor)."""
    model, kw, stock = _greedy_call(seed=2)
    ours = dict(invisible_lora=True, gate="always", num_draft_tokens=2, draft_dtype=torch.int8)
    with torch.inference_mode():
        assert torch.equal(model.generate(**kw, **ours), stock)
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["s"].weight.data.mul_(2)  # a later edit
    stock = model.generate(**kw)
    assert torch.equal(model.generate(**kw, **ours), stock)
