"""First-call latency: a new process's first generate() call, with the defaults and with compiled passes.

Each measurement is a fresh Python process (what a user's script or a restarted server is):
  stock       stock PEFT generate(adapter_names=), the reference;
  default_untuned  every option at its default (gate="auto", compile="auto": eager on the CPU), on a
              machine whose choices are not measured yet (an empty HF_INVISIBLELORA_HOME/tuning: the
              first call measures them, tuning.py);
  default     the same in the next process, which reads them;
  eager       compile=False: the first call and a second one (the reference);
  cold        compile=True with an empty Inductor cache folder: the first call compiles every pass;
  warm        compile=True again in a new process on the cache the cold run left (Inductor's on-disk
              FX-graph and AOTAutograd caches): what a second run of the same script pays.
The zoo's SmolLM2 with its first adapter, greedy, --new-tokens tokens from a 32-token prompt,
``gate="never"`` (one pass kind: the plain LoRA-on step) unless --gate says otherwise.

    python -P benchmarks/bench_first_call.py --batch 1 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import machine

CHILD = r"""
import json, sys, time, torch
import hf_invisiblelora
from hf_invisiblelora import zoo
torch.set_num_threads({threads})
t0 = time.perf_counter()
model, tok, names = zoo.load_zoo("smollm2", ["{adapter}"])
prompts, rows = zoo.mixed_prompts("smollm2", tok, names, {batch}, 32)
tok.padding_side = "left"
enc = tok(prompts, return_tensors="pt", padding=True)
load = time.perf_counter() - t0
times = []
for _ in range(2):
    t = time.perf_counter()
    model.generate(**enc, adapter_names=rows, max_new_tokens={new}, do_sample=False, pad_token_id=tok.pad_token_id,
                   {options})
    times.append(time.perf_counter() - t)
print(json.dumps(dict(load_s=load, first_s=times[0], second_s=times[1])))
"""


def run(code: str, cache: str, home: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "HF_INVISIBLELORA_HOME": home}
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--gate", default="never")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--adapter", default="shakespeare")
    p.add_argument("--no-compiled", action="store_true", help="leave out the compiled ways (cold, warm)")
    p.add_argument("--out", default="benchmarks/results/first_call.json")
    args = p.parse_args(argv)
    fill = dict(threads=args.threads, adapter=args.adapter, batch=args.batch, new=args.new_tokens)
    ours = 'invisible_lora=True, gate="{}", compile={}'.format
    results = {}
    home = os.environ.get("HF_INVISIBLELORA_HOME", str(Path.home() / ".cache" / "hf_invisiblelora"))
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as fresh:
        results["stock"] = run(CHILD.format(options="", **fill), cache, home)
        # A machine's first process measures its choices (tuning.py), the next reads them.
        os.symlink(os.path.join(home, "models"), os.path.join(fresh, "models"))
        os.symlink(os.path.join(home, "zoo"), os.path.join(fresh, "zoo"))
        results["default_untuned"] = run(CHILD.format(options='invisible_lora=True', **fill), cache, fresh)
        results["default"] = run(CHILD.format(options='invisible_lora=True', **fill), cache, fresh)
        results["eager"] = run(CHILD.format(options=ours(args.gate, False), **fill), cache, home)
        if not args.no_compiled:
            results["cold"] = run(CHILD.format(options=ours(args.gate, True), **fill), cache, home)
            results["warm"] = run(CHILD.format(options=ours(args.gate, True), **fill), cache, home)
    print(f"CPU {machine()}; batch {args.batch}, {args.new_tokens} new tokens, gate={args.gate}, {args.threads} threads; seconds")
    print("| way | model load | first call | second call |")
    print("|---|---|---|---|")
    for way, r in results.items():
        print(f"| {way} | {r['load_s']:.1f} | {r['first_s']:.1f} | {r['second_s']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command="python benchmarks/bench_first_call.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                   cpu=machine(), results=results), indent=1))


if __name__ == "__main__":
    main()
