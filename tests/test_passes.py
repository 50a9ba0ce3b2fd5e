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
