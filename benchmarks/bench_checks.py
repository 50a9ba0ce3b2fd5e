"""What checking the derived copies against their sources costs per call (hf_invisiblelora/model/derived.py).

On the real SmolLM2-135M-Instruct (float32) with four random adapters of the zoo's kinds (r8
attention, r32 rslora all-linear, r4 q/v, r16 MLP), copies made by a warm call: the digests of
every source a call reads (the prepacked layers' weights, the bank's slots of the call's adapters,
the int8 draft copies and a restricted draft head), each component alone and a whole Session's
assembly (what one generate() call checks); the row-sum check the prepacked layers had before, for
comparison; and a default generate() call (8 rows, 32 new tokens) to set them against.

    python -P benchmarks/bench_checks.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
import hf_invisiblelora  # noqa: E402,F401
from common import machine, timed  # noqa: E402
from hf_invisiblelora import zoo  # noqa: E402
from hf_invisiblelora.decode.drafters import BaseModelDrafter  # noqa: E402
from hf_invisiblelora.decode.policies import GeneratePolicy  # noqa: E402
from hf_invisiblelora.decode.session import Session  # noqa: E402
from hf_invisiblelora.lora.bank import get_bank  # noqa: E402
from hf_invisiblelora.model.derived import SourceCheck  # noqa: E402
from hf_invisiblelora.model.prepack import PackedLinears  # noqa: E402
from hf_invisiblelora.model.state import state_of  # noqa: E402
from hf_invisiblelora.model.walk import linears  # noqa: E402
from tiny import LINEAR, with_adapters  # noqa: E402

ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all": dict(r=32, lora_alpha=32, use_rslora=True, target_modules=LINEAR),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.assets.prepare("smollm2")
    torch.manual_seed(0)
    model = with_adapters(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), ADAPTERS, 0.05)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    names = list(ADAPTERS) * 2
    enc = tok([f"Prompt number {i} says that" for i in range(len(names))], return_tensors="pt", padding=True)
    kw = dict(adapter_names=names, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    state = state_of(model)
    with torch.no_grad():
        model.generate(**enc, invisible_lora=True, draft_dtype=torch.int8, draft_vocab=8192, **kw)  # copies made
        drafter = BaseModelDrafter(model, state, torch.arange(8192), torch.int8)
        weights = list({id(m.weight): m.weight for m in linears(model)}.values())

        def drafter_check():
            with drafter.installed(None, SourceCheck()):
                pass

        rows = [
            ("digests of every linear weight (xxh3-128)", lambda: SourceCheck()(tuple(weights))),
            ("prepacked layers, all kept (PackedLinears)", lambda: PackedLinears(model, state, True, SourceCheck())),
            ("the bank's slots of 4 adapters", lambda: get_bank(model, set(ADAPTERS), SourceCheck())),
            ("int8 draft copies + restricted head", drafter_check),
            ("a Session's assembly (all of the above, one check)",
             lambda: Session(model, state, GeneratePolicy([], False), capacity=len(names), width=64, mixed=True,
                             drafters=[drafter], pad_id=0)),
            ("before: row sums of every weight's bits",
             lambda: [w.view(torch.int32).sum(1, dtype=torch.int32) for w in weights]),
        ]
        mb = sum(w.numel() * w.element_size() for w in weights) / 2**20
        print(f"# {machine()}, {args.threads} threads; SmolLM2-135M float32, {len(weights)} weights ({mb:.0f} MB)")
        print("| check | ms per call |\n|---|---:|")
        for label, fn in rows:
            fn()
            print(f"| {label} | {timed(fn, args.repeats)[0] * 1e3:.1f} |")
        call = timed(lambda: model.generate(**enc, invisible_lora=True, **kw), 3)[0]
        print(f"| a default generate() call, {len(names)} rows x 32 tokens (for scale) | {call * 1e3:.0f} |")


if __name__ == "__main__":
    main()
