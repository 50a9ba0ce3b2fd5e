"""The cost of one decode step, and what its bytes say it should cost.

One decode step of every row against a 64-token cache, on a real model with its zoo adapters
(rows assigned to the adapters round-robin), timed side by side (interleaved, medians):

- base step: the bare base model (no PEFT wrapper), stock forward with a DynamicCache;
- draft pass: our LoRA-off pass (the base-model drafter) through the engine's forward, SharedCache;
  and the cheaper drafters (drafters.py, BaseModelDrafter's options): the head on a vocabulary of
  the --draft-vocab most frequent tokens of the zoo's training text, and bfloat16 draft weights;
- LoRA-on step: our pass with each row's adapter (the adapter bank), SharedCache;
- stock PEFT step: PEFT's forward with adapter_names, DynamicCache;
- verify of 3 tokens per row: our LoRA-on pass over 3 tokens;
- lm_head alone: the output projection of the rows' last hidden states;
- with --compiled: the draft pass, LoRA-on step and verify of 3 tokens again as ``compile=True``
  runs them (CompiledForward, inductor: rows and cache length padded to their buckets; compiled
  in the untimed warm-up round, the compile time printed), and the int4 drafter's pass eager and
  compiled (a draft pass need not be exact, so only its cost counts); TORCHINDUCTOR_FREEZING=1 in
  the environment compiles them with Inductor's weight freezing;
- with --copied-kv: our draft and LoRA-on passes (and compiled ones with --compiled) again with
  the key/value heads copied per query head as Transformers does (repeat_kv) instead of read in
  place (layout._use_gqa, inside our passes): the A/B of that choice, in the same interleaved rounds;
- with --prepack: our eager passes on prepacked linear layers (prepack.py, generate()'s default where
  it applies; compiled passes never use them);
- bound: base step x (base weight bytes + the batch's distinct adapters' bytes) / base weight bytes,
  what reading the weights alone would add.

    python benchmarks/bench_step.py [--model smollm2|gemma3] [--batches 1 4 8 16] [--adapters 1 4 12] [--repeats 7]
                                    [--draft-vocab 8192] [--compiled] [--copied-kv] [--prepack]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
from transformers import DynamicCache, LogitsProcessorList

import hf_invisiblelora  # noqa: F401
from hf_invisiblelora import zoo
from hf_invisiblelora.decode.drafters import BaseModelDrafter
from hf_invisiblelora.decode.policies import GeneratePolicy
from hf_invisiblelora.decode.session import Session
from hf_invisiblelora.model import layout
from hf_invisiblelora.model.state import state_of

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import interleaved, machine

CONTEXT = 64


SHORT = {torch.bfloat16: "bf16"}  # the draft dtypes' names in the tables (else torch's: int8, int4)


def adapter_bytes(model, name: str) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n)


def base_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)


class Setup:
    """The passes of one (batch, adapters) point, each a callable timing one step, on the decoder
    generate() assembles (decode/session.py: the bank's LoRA switch, the forward, the drafters, the
    prepacked layers). Made and timed inside ``state_of(model).hold()``: the pass contexts' owner
    check is the model state's."""

    def __init__(self, model, names, batch, vocab, draft_vocab, compiled=False, prepack=False,
                 draft_dtypes=(torch.bfloat16,), compiled_drafters=()):
        self.model, self.inner = model, model.get_base_model()
        self.rows = [names[i % len(names)] for i in range(batch)]
        g = torch.Generator().manual_seed(batch)
        self.prompt = torch.randint(3, vocab, (batch, CONTEXT), generator=g)
        self.next = torch.randint(3, vocab, (batch, 3), generator=g)
        state = state_of(model)
        self.drafter = BaseModelDrafter(model, state)  # the base model as it is: the default drafter
        self.drafters = {"draft_vocab": BaseModelDrafter(model, state, torch.tensor(draft_vocab)),
                         **{f"draft_{SHORT.get(d, str(d)[6:])}": BaseModelDrafter(model, state, dtype=d)
                            for d in draft_dtypes}}
        self.start = torch.full((batch,), CONTEXT, dtype=torch.long)
        # One decoder per drafter, as generate() installs only the drafters it is given (each one
        # routes the layers it changes, which would reach the other passes' timing too).
        self.sessions = {(False, None): self._session(state, batch, prepack, None, self.drafter)}
        for name, drafter in self.drafters.items():
            self.sessions[False, name] = self._session(state, batch, prepack, None, drafter)
        if compiled:
            self.sessions[True, None] = self._session(state, batch, False, "inductor", self.drafter)
        for name in compiled_drafters:  # a cheaper drafter's pass compiled too
            self.sessions[True, name] = self._session(state, batch, False, "inductor", self.drafters[name])
        self.stock_cache = self._stock_prefill(adapters=True)
        self.base_cache = self._stock_prefill(adapters=False)
        self.hidden = torch.randn(batch, 1, self.inner.config.get_text_config().hidden_size)

    def _session(self, state, batch: int, prepack: bool, backend, drafter):
        """generate()'s assembly for ``batch`` rows with ``drafter``, its prompt prefilled (the rows' adapters)."""
        session = Session(self.model, state, GeneratePolicy(LogitsProcessorList(), False), capacity=batch,
                          width=CONTEXT + 8, mixed=True, gate="never", num_draft_tokens=2,
                          drafters=[drafter], compile_backend=backend, prepack=prepack, pad_id=0)
        mask = torch.ones_like(self.prompt)
        with session.installed() as decoder, torch.no_grad():
            decoder.admit(list(range(batch)), self.prompt, mask, mask.cumsum(-1) - 1, [8] * batch, self.rows)
        return session

    def installed(self, compiled: bool = False, drafter: str | None = None):
        """The (untimed) context of our passes: the session installed (its LoRA switch, its drafter
        and, eager, prepacked layers) with its forward's pass context."""
        return self.sessions[compiled, drafter].installed

    def ours(self, lora_on: bool, q: int, compiled: bool = False, drafter: str | None = None):
        """Our pass of q tokens per row: LoRA on, or a draft pass (the default drafter, or the one
        named ``drafter``)."""
        session = self.sessions[compiled, drafter]
        ids, fwd = self.next[:, :q], session.fwd
        passed = None if lora_on else session.drafters[0]

        def step():
            if passed is not None:
                passed.ready()  # its copies made before the pass, as Decoder.cycle has them (a no-op once made)
            return fwd(ids, self.start, CONTEXT + q, keep=q, drafter=passed)
        return step

    def drafted(self, name: str):
        """(context, step): a draft pass with one of the cheaper drafters."""
        return self.installed(drafter=name), self.ours(False, 1, drafter=name)

    def _stock_prefill(self, adapters: bool):
        cache = DynamicCache(config=self.inner.config)
        with torch.no_grad():
            if adapters:
                self.model(input_ids=self.prompt, cache=cache, use_cache=True, adapter_names=self.rows, logits_to_keep=1)
            else:
                with self.model.disable_adapter():
                    self.inner(input_ids=self.prompt, cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def stock(self, adapters: bool):
        cache = self.stock_cache if adapters else self.base_cache

        def step():
            kw = dict(adapter_names=self.rows) if adapters else {}
            (self.model if adapters else self.inner)(input_ids=self.next[:, :1], cache=cache, use_cache=True,
                                                     logits_to_keep=1, **kw)
            cache.crop(-1)  # back to the 64-token context
        return step

    def lm_head(self):
        head = self.inner.get_output_embeddings()
        return lambda: head(self.hidden)


def copied_kv(context):
    """``context`` with our passes copying KV heads as Transformers does: SDPA's GQA switch
    (layout._use_gqa) told that no pass of ours is running, so it makes Transformers' choice."""
    @contextlib.contextmanager
    def both():
        saved, layout.in_pass = layout.in_pass, lambda: False
        try:
            with context():
                yield
        finally:
            layout.in_pass = saved
    return both


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=list(zoo.ZOOS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--adapters", nargs="+", type=int, default=[1, 4, 12])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--compiled", action="store_true", help="also time the compiled passes (compile=True), and the "
                   "int4 drafter's pass eager and compiled (TORCHINDUCTOR_FREEZING=1: Inductor's weight freezing)")
    p.add_argument("--copied-kv", action="store_true", help="also time our passes with repeat_kv copies (A/B)")
    p.add_argument("--prepack", action="store_true", help="our eager passes on prepacked linear layers (prepack.py)")
    p.add_argument("--out", default="benchmarks/results/step.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, names = zoo.load_zoo(args.model)
    vocab = model.get_base_model().config.get_text_config().vocab_size
    weights = base_bytes(model.get_base_model())
    draft_vocab = zoo.corpus_vocabulary(args.model, tok, args.draft_vocab)
    results = []
    print(f"{args.model}: {len(names)} adapters; eager passes {'prepacked' if args.prepack else 'on F.linear'}; CPU {machine()}, "
          f"{torch.get_num_threads()} threads; ms per step, medians of {args.repeats}")
    compiled = ["draft_c", "lora_c", "verify3_c", "draft_int4_c"] if args.compiled else []
    print("| batch | adapters | base step | draft pass | draft, vocab | draft, bf16 | LoRA-on step (x base) | "
          "bound (x base) | LoRA-on / bound | stock PEFT step | verify 3 tokens | lm_head |"
          + (" compiled: draft / LoRA-on / verify 3 / int4 draft (x eager) | compile s |" if compiled else ""))
    print("|---" * (12 + 2 * bool(compiled)) + "|")
    for batch in args.batches:
        for a in args.adapters:
            if a > batch or a > len(names):
                continue
            with state_of(model).hold():
                s = Setup(model, names[:a], batch, vocab, draft_vocab, args.compiled, args.prepack,
                          draft_dtypes=(torch.bfloat16, torch.int4) if compiled else (torch.bfloat16,),
                          compiled_drafters=("draft_int4",) if compiled else ())
                active = set(s.rows)
                bound = (weights + sum(adapter_bytes(model, n) for n in active)) / weights
                ours, off, plain = s.installed(), model.disable_adapter, contextlib.nullcontext
                steps = {"base": (off, s.stock(False)), "draft": (ours, s.ours(False, 1)),
                         "lora": (ours, s.ours(True, 1)), "stock": (plain, s.stock(True)),
                         "verify3": (ours, s.ours(True, 3)), "lm_head": (plain, s.lm_head()),
                         "draft_vocab": s.drafted("draft_vocab"), "draft_bf16": s.drafted("draft_bf16")}
                for name, (lora_on, q) in zip(compiled, [(False, 1), (True, 1), (True, 3)]):
                    steps[name] = (s.installed(compiled=True), s.ours(lora_on, q, compiled=True))
                if compiled:
                    steps["draft_int4"] = s.drafted("draft_int4")
                    steps["draft_int4_c"] = (s.installed(True, "draft_int4"), s.ours(False, 1, True, "draft_int4"))
                ab = [k for k in ("draft", "lora", *compiled[:2]) if args.copied_kv]
                for name in ab:
                    steps[name + "_copied"] = (copied_kv(steps[name][0]), steps[name][1])
                t, first = interleaved(steps, args.repeats)
            r = dict(batch=batch, adapters=a, bound=bound, **{k: 1000 * v for k, v in t.items()})
            if compiled:
                r["compile_s"] = {k: first[k] - t[k] for k in compiled}
            results.append(r)
            extra = " {:.1f} ({:.2f}x) / {:.1f} ({:.2f}x) / {:.1f} ({:.2f}x) / {:.1f} ({:.2f}x) | {} |".format(
                *(v for k in compiled for v in (r[k], r[k] / r[k[:-2]])),
                " / ".join(f"{v:.0f}" for v in r["compile_s"].values())) if compiled else ""
            print(f"| {batch} | {a} | {r['base']:.1f} | {r['draft']:.1f} | {r['draft_vocab']:.1f} | {r['draft_bf16']:.1f} | "
                  f"{r['lora']:.1f} ({r['lora'] / r['base']:.2f}x) | "
                  f"{bound:.2f}x | {r['lora'] / r['base'] / bound:.2f} | {r['stock']:.1f} | {r['verify3']:.1f} | "
                  f"{r['lm_head']:.1f} |" + extra, flush=True)
            if ab:
                print("    KV heads read in place / copied (repeat_kv): " + ", ".join(
                    f"{k} {r[k]:.1f} / {r[k + '_copied']:.1f} ms ({r[k] / r[k + '_copied']:.2f}x)" for k in ab), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command="python benchmarks/bench_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                   cpu=machine(), threads=torch.get_num_threads(), draft_vocab=args.draft_vocab,
                                   results=results), indent=1))


if __name__ == "__main__":
    main()
