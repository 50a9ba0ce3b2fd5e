"""A training loop's serving: one adapter reloaded in place while clients stream from it.

On the zoo (SmolLM2-135M-Instruct), the adapter "policy" is reloaded in place (``load_adapter(...,
inplace=True)``, vLLM's ``load_inplace``) --reloads times, its revisions taking the folders of
--adapters in turn (revision r: adapter r % len), one reload every --interval seconds, while
--clients threads each send greedy requests (held-out prompts, --max-tokens) to "policy" and read
their tokens as they stream. Each request is served by the revision it was admitted with
(``Handle.revision``), also when a reload comes while it decodes. Afterwards every answer is compared
with stock PEFT's generate() of its prompt under that revision's adapter.

--checkpoints N: the revisions are N checkpoints of the first adapter instead, of the same shape as
a training loop writes them (its lora_B scaled by 1 + 0.1 i, saved), so a reload that finds no
request on the old revision writes the new weights in place.

    python -P benchmarks/bench_reload.py
    python -P benchmarks/bench_reload.py --checkpoints 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from hf_invisiblelora import zoo
from hf_invisiblelora.engine import Engine, Request

ADAPTERS = ["kjv", "shakespeare", "python_code", "humaneval"]


def checkpoints(model, adapter: str, n: int, root: Path) -> list[str]:
    """n checkpoints of ``adapter`` with its shape (lora_B scaled by 1 + 0.1 i), saved under ``root``."""
    folders = []
    with torch.no_grad():
        saved = {k: v.clone() for k, v in model.named_parameters() if f"lora_B.{adapter}." in k}
        params = dict(model.named_parameters())
        for i in range(n):
            for k, v in saved.items():
                params[k].copy_(v * (1 + 0.1 * i))
            model.save_pretrained(root / str(i), selected_adapters=[adapter])
            folders.append(str(root / str(i) / adapter))
        for k, v in saved.items():
            params[k].copy_(v)
    return folders


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
    p.add_argument("--alternate", action="store_true", help="as an RL loop: clients wait while a reload runs, and "
                                                                "a reload waits for the requests in flight")
    p.add_argument("--checkpoints", type=int, default=0, help="revisions: this many same-shape checkpoints of the "
                                                                   "first adapter (0: the adapters' folders)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok, names = zoo.load_zoo("smollm2", args.adapters)
    folders = [str(zoo.zoo_dir("smollm2") / name) for name in args.adapters]
    domains = list(args.adapters)
    if args.checkpoints:
        folders = checkpoints(model, args.adapters[0], args.checkpoints, Path(tempfile.mkdtemp()))
        for i, folder in enumerate(folders):  # the references, as revisions are compared below
            model.load_adapter(folder, adapter_name=f"checkpoint{i}")
        args.adapters = [f"checkpoint{i}" for i in range(args.checkpoints)]
    prompts = [tok(text).input_ids for name in domains
               for text in zoo.adapter_prompts("smollm2", tok, name, 8, args.prompt_tokens, seed=1)]
    served = []  # (prompt, tokens, revision, reloads seen while it ran)
    lock, stop = threading.Lock(), threading.Event()
    engine = Engine(model, max_batch=8, max_len=256).start()
    reloads_done = [0]

    serving, idle = threading.Event(), threading.Condition(lock)  # --alternate: generation and updates take turns
    serving.set()
    in_flight = [0]

    def client(c):
        i = c
        while not stop.is_set():
            serving.wait()
            prompt = prompts[i % len(prompts)]
            before = reloads_done[0]
            with lock:
                in_flight[0] += 1
            h = engine.submit(Request(prompt, adapter="policy", max_tokens=args.max_tokens, temperature=0))
            tokens = [t for chunk in h for t in chunk]  # streamed
            with lock:
                served.append((prompt, tokens, h.revision, reloads_done[0] - before))
                in_flight[0] -= 1
                idle.notify_all()
            i += args.clients

    try:
        engine.load_adapter("policy", folders[0])
        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        reload_seconds = []
        for r in range(1, args.reloads + 1):
            time.sleep(args.interval)
            if args.alternate:
                serving.clear()
                with lock:
                    idle.wait_for(lambda: in_flight[0] == 0)
            t = time.perf_counter()
            engine.load_adapter("policy", folders[r % len(folders)], inplace=True)
            reload_seconds.append(time.perf_counter() - t)
            reloads_done[0] = r
            serving.set()
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
                  revisions_left=left, tokens_per_s=generated / seconds, seconds=seconds,
                  reload_seconds_median=statistics.median(reload_seconds))
    print(f"{result['command']}\n{machine()}, {torch.get_num_threads()} threads\n")
    print(f"{args.reloads} reloads in place, one every {args.interval} s, {args.clients} clients streaming: "
          f"{len(served)} requests ({spanning} of them in flight while a reload came), {generated / seconds:.1f} "
          f"tokens/s; {identical} of {len(served)} answers identical to stock generate() under the revision that "
          f"served them; revisions served {len(result['revisions_served'])}; old revisions left at the end: {left}; "
          f"a reload took {result['reload_seconds_median']:.2f} s (median)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
