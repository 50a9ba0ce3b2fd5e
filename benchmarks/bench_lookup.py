"""How often prompt lookup's proposals are right, by the length of the match they continue.

For each adapter, its greedy continuations of held-out prompts (LoRA on, stock generate()); at every
position t of a continuation, prompt lookup (hf_invisiblelora/decode/prompt_lookup.py: ``match`` and
``lookup`` over the committed tokens, prompt + continuation up to t) proposes k tokens, and a cycle
would keep the proposals up to the first that differs from the continuation, plus the target's own
token. Reported per shortest n-gram length allowed (1, 2, 3) and k: the tokens a cycle commits per
row where lookup has a match (the mean over positions), the share of positions with a match, and the
per-draft acceptance after a match of each length (accepted / judged drafts, the gate's Bernoulli).
No timing: this is what the gate learns per match length (gate.py), measured offline.

    python -P benchmarks/bench_lookup.py --adapters humaneval kjv python_code shakespeare
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, zoo_continuations_args

from hf_invisiblelora.decode.prompt_lookup import LOOKUP_NGRAMS, lookup, match


def continuations(model, tok, zoo_name: str, names, prompts: int, prompt_tokens: int, new_tokens: int):
    """[(adapter, token ids: prompt + greedy continuation, prompt length)]."""
    from hf_invisiblelora import zoo

    out = []
    for name in names:
        model.set_adapter(name)
        for text in zoo.adapter_prompts(zoo_name, tok, name, prompts, prompt_tokens, seed=11):
            ids = tok(text, return_tensors="pt").input_ids
            with torch.no_grad():
                seq = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0]
            out.append((name, seq, ids.shape[1]))
    return out


def simulate(runs, shortest: int, k: int) -> dict:
    """Per position of every continuation: lookup over the tokens before it, with n-grams from
    LOOKUP_NGRAMS[0] down to ``shortest``; kept drafts counted as a cycle keeps them."""
    committed, matched, positions = 0, 0, 0
    per_n = collections.defaultdict(lambda: [0, 0])  # n -> [accepted, judged]
    for _, seq, start in runs:
        for t in range(start, len(seq)):
            ctx = seq[:t][None]
            m = match(ctx, torch.tensor([t]), LOOKUP_NGRAMS[0], shortest)
            positions += 1
            n = int(m.ngram)
            if not n:
                continue
            matched += 1
            proposal = lookup(ctx, m, k)[0].tolist()
            truth = seq[t : t + k].tolist()
            kept = 0
            while kept < min(k, len(truth)) and proposal[kept] == truth[kept]:
                kept += 1
            committed += kept + 1
            per_n[n][0] += kept
            per_n[n][1] += kept + (kept < min(k, len(truth)))
    return dict(tokens_per_cycle=committed / max(matched, 1), matched=matched / max(positions, 1),
                acceptance={n: a / max(j, 1) for n, (a, j) in sorted(per_n.items())})


def main(argv=None):
    from hf_invisiblelora import zoo

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    zoo_continuations_args(p, new_tokens=48)
    args = p.parse_args(argv)
    model, tok, names = zoo.load_zoo(args.zoo, args.adapters)
    runs = continuations(model, tok, args.zoo, names, args.prompts, args.prompt_tokens, args.new_tokens)
    print(f"python -P benchmarks/bench_lookup.py {' '.join(sys.argv[1:] if argv is None else argv)}\n{machine()}; "
          f"{args.zoo}, adapters {', '.join(names)}; {len(runs)} continuations of {args.new_tokens} tokens\n")
    print("| shortest n-gram | k | positions with a match | tokens a cycle commits where matched | "
          "per-draft acceptance after a match of 3 / 2 / 1 |\n|---|---|---:|---:|---|")
    for shortest in (3, 2, 1):
        for k in (1, 2, 4):
            r = simulate(runs, shortest, k)
            acc = " / ".join(f"{r['acceptance'][n]:.2f}" if n in r["acceptance"] else "-" for n in (3, 2, 1))
            print(f"| {shortest} | {k} | {r['matched']:.0%} | {r['tokens_per_cycle']:.2f} | {acc} |", flush=True)


if __name__ == "__main__":
    main()
