"""A training loop's serving: one adapter reloaded in place while clients stream from it.

On the zoo (SmolLM2-135M-Instruct), the adapter "policy" is reloaded in place (``load_adapter(...,
inplace=True)``, vLLM's ``load_inplace``) --reloads times, its revisions taking the folders of
--adapters in turn (revision r: adapter r % len), one reload every --interval seconds, while
--clients threads each send greedy requests (held-out prompts, --max-tokens) to "policy" and read
their tokens as they stream. Each request is served by the revision it was admitted with
(``Handle.revision``), also when a reload comes while it decodes. Afterwards every answer is compared
with stock PEFT's generate() of its prompt under that revision's adapter.

    python -P benchmarks/bench_reload.py
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from hf_invisiblelora import zoo
from hf_invisiblelora.engine import Engine, Request

ADAPTERS = ["kjv", "shakespeare", "python_code", "humaneval"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", nargs="+", default=ADAPTERS)
    p.add_argument("--reloads", type=int, default=50)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between two reloads (a training step)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/reload.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, names = zoo.load_zoo("smollm2", args.adapters)
    folders = [str(zoo.zoo_dir("smollm2") / name) for name in args.adapters]
    prompts = [tok(text).input_ids for name in args.adapters
               for text in zoo.adapter_prompts("smollm2", tok, name, 8, args.prompt_tokens, seed=1)]
    served = []  # (prompt, tokens, revision, reloads seen while it ran)
    lock, stop = threading.Lock(), threading.Event()
    engine = Engine(model, max_batch=8, max_len=256).start()
    reloads_done = [0]

    def client(c):
        i = c
        while not stop.is_set():
            prompt = prompts[i % len(prompts)]
            before = reloads_done[0]
            h = engine.submit(Request(prompt, adapter="policy", max_tokens=args.max_tokens, temperature=0))
            tokens = [t for chunk in h for t in chunk]  # streamed
            with lock:
                served.append((prompt, tokens, h.revision, reloads_done[0] - before))
            i += args.clients

    try:
        engine.load_adapter("policy", folders[0])
        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for r in range(1, args.reloads + 1):
            time.sleep(args.interval)
            engine.load_adapter("policy", folders[r % len(folders)], inplace=True)
            reloads_done[0] = r
        stop.set()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
    finally:
        engine.stop()
    left = [a for a in model.peft_config if "#" in a]
    generated = sum(len(tokens) for _, tokens, _, _ in served)
    identical = 0
    for prompt, tokens, revision, _ in served:
        adapter = args.adapters[revision % len(args.adapters)]
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), adapter_names=[adapter],
                                 max_new_tokens=args.max_tokens, do_sample=False)
        identical += out[0, len(prompt):].tolist() == tokens
    spanning = sum(1 for *_, seen in served if seen)
    result = dict(command="python -P benchmarks/bench_reload.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  machine=machine(), reloads=args.reloads, requests=len(served), identical=identical,
                  spanning_a_reload=spanning, revisions_served=sorted({r for _, _, r, _ in served}),
                  revisions_left=left, tokens_per_s=generated / seconds, seconds=seconds)
    print(f"{result['command']}\n{machine()}, {torch.get_num_threads()} threads\n")
    print(f"{args.reloads} reloads in place, one every {args.interval} s, {args.clients} clients streaming: "
          f"{len(served)} requests ({spanning} of them in flight while a reload came), {generated / seconds:.1f} "
          f"tokens/s; {identical} of {len(served)} answers identical to stock generate() under the revision that "
          f"served them; revisions served {len(result['revisions_served'])}; old revisions left at the end: {left}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
