"""The command line: loading the model and adapters, the drain on SIGTERM, and main()."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

import torch
import uvicorn
from starlette.concurrency import run_in_threadpool

from ..options import DRAFT_DTYPES, GATES, PREFILL_CHUNK, PREPACK, Limits, Options
from .admin import missing
from .grammars import MAX_PENDING
from .app import Server, build_app
from .protocol import MAX_BODY_BYTES
from .structured import GRAMMAR_COMPILE_TIMEOUT

logger = logging.getLogger("hf_invisiblelora.serve")

DTYPES = ("float32", "float64", "bfloat16", "float16")
SHUTDOWN_TIMEOUT = 30  # --shutdown-timeout, seconds
API_KEY_ENV = "HF_INVISIBLELORA_API_KEY"
RUNTIME_LORA_ENV = "HF_INVISIBLELORA_ALLOW_RUNTIME_LORA_UPDATING"  # as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING


class Graceful(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown. On the first SIGTERM (or SIGINT) new
    requests get 503 (FrontDoor) while those in flight finish, for up to ``timeout`` seconds; then
    the engine stops, which ends what still runs (a stream with an error event and ``[DONE]``, a
    waiting call with 503), and uvicorn shuts down (its graceful shutdown lets those last
    responses go out; the lifespan's end stops the engine, already stopped). A second signal is
    uvicorn's own: its shutdown starts at once."""

    def __init__(self, config: uvicorn.Config, server: Server, timeout: float):
        super().__init__(config)
        self.app_server, self.timeout = server, timeout
        self.loop = self.drain_task = None

    async def serve(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if self.app_server.draining:
            return super().handle_exit(sig, frame)
        self.app_server.draining = True
        # A signal handler runs between two steps of the event loop's thread: the drain starts as a task of its own.
        self.loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self):
        self.drain_task = self.loop.create_task(self.drain())  # held: the loop keeps only weak references

    async def drain(self):
        server = self.app_server
        deadline = self.loop.time() + self.timeout
        logger.info("shutting down: new requests get 503; %d in flight have %g s to finish", server.active,
                    self.timeout)
        try:
            while server.active and self.loop.time() < deadline:
                await asyncio.sleep(0.05)
            if server.active:
                logger.warning("ending %d request(s) still running after %g s", server.active, self.timeout)
            await run_in_threadpool(server.engine.stop)
        finally:  # whatever happens, uvicorn shuts down
            self.should_exit = True


def load_model(path: str, loras: list[tuple[str, str]], dtype: str = "float32"):
    """(PeftModel in eval mode with every adapter loaded, tokenizer) from a base model folder."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not loras:
        raise SystemExit("error: give at least one --lora NAME=PATH (more can be loaded while serving)")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    (first, first_path), rest = loras[0], loras[1:]
    model = PeftModel.from_pretrained(base, first_path, adapter_name=first)
    for name, adapter_path in rest:
        model.load_adapter(adapter_path, adapter_name=name)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def load_zoo_model(name: str, adapters: list[str] | None, dtype: str):
    """(model, tokenizer, base model folder, {adapter: its folder}): the zoo's base model with its
    adapters (``adapters``; default: every built plain LoRA one, or the demo's four, trained first,
    when none is built)."""
    import torch

    from .. import zoo
    from ..zoo.demo import DEMO_ADAPTERS

    if not adapters:
        adapters = zoo.built_adapters(name) or (DEMO_ADAPTERS if name == "smollm2" else None)
    zoo.build(name, only=adapters)  # a no-op when they are built
    model, tokenizer, names = zoo.load_zoo(name, adapters, dtype=getattr(torch, dtype))
    return model, tokenizer, str(zoo.assets.prepare(name)), {n: str(zoo.zoo_dir(name) / n) for n in names}


def parse_lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


LIMITS, OPTIONS = Limits(), Options()  # the defaults
PREPACK_FLAGS = dict(zip(("auto", "on", "off"), PREPACK))  # --prepack's words for options.PREPACK
DRAFT_DTYPE_NAMES = ("auto", "float32", *(str(d).removeprefix("torch.") for d in DRAFT_DTYPES))


def engine_arguments(args: argparse.Namespace) -> dict:
    """The Engine's decoding options and bounds from ``args`` (options.Options and Limits: checked
    there, a ValueError naming the option)."""
    names = args.draft_dtype
    dtypes = tuple(None if n == "float32" else getattr(torch, n) for n in names if n != "auto")
    if "auto" in names and names != ["auto"]:
        raise ValueError(f"--draft-dtype auto stands alone, got {' '.join(names)}.")
    options = Options(num_draft_tokens=args.num_draft_tokens, gate=args.gate, compile=False,
                      draft_dtype="auto" if not dtypes else dtypes[0] if len(dtypes) == 1 else dtypes,
                      prompt_lookup=args.prompt_lookup == "on", prepack=PREPACK_FLAGS[args.prepack])
    limits = Limits(max_batch=args.max_batch, max_len=args.max_len, max_queue=args.max_queue, max_loras=args.max_loras,
                    max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank,
                    prefill_chunk=PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk or None,
                    prefix_caching=args.enable_prefix_caching, prefix_cache_bytes=args.prefix_cache_bytes)
    taken = {f: getattr(options, f) for f in Options.names() if f not in ("lora_backend", "compile")}
    return {**taken, **dataclasses.asdict(limits)}


def parser() -> argparse.ArgumentParser:
    """The server's options (the Ray Serve application takes the same: ray_app.py)."""
    p = argparse.ArgumentParser(
        prog="python -m hf_invisiblelora.serve",
        description="An OpenAI-compatible server for a base model and its LoRA adapters: every request names "
                    "an adapter (its model), and one mixed batch decodes them all, as each would decode alone.",
        epilog="docs/serving.md has the API, every request parameter, the security model and the metrics.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="base model folder (AutoModelForCausalLM.from_pretrained)")
    source.add_argument("--zoo", choices=("smollm2", "gemma3"), help="serve a zoo base model and its adapters")
    p.add_argument("--lora", action="append", type=parse_lora, default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA adapter folder served as model NAME (repeatable)")
    p.add_argument("--adapters", nargs="+", help="with --zoo: the zoo adapters to serve (default: every built one)")
    p.add_argument("--served-model-name", help="the base model's id in the API (default: --model as given, or the zoo name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=LIMITS.max_batch, help="rows decoded together")
    p.add_argument("--max-len", type=int, default=LIMITS.max_len,
                   help="cache slots per row: prompt + max_tokens + drafts + 1")
    p.add_argument("--max-queue", type=int, default=LIMITS.max_queue, help="requests waiting for a row before 429")
    p.add_argument("--max-loras", type=int, help="the most distinct adapters in one pass (default: no bound)")
    p.add_argument("--max-cpu-loras", type=int,
                   help="the most adapters kept loaded, resolved ones included; idle ones are evicted LRU and loaded "
                        "again on demand (default: --max-loras, else --max-batch, or the adapters given and one more)")
    p.add_argument("--max-lora-rank", type=int, default=LIMITS.max_lora_rank,
                   help="the largest rank of an adapter loaded while serving, checked before anything is allocated "
                        "for it (vLLM's --max-lora-rank)")
    p.add_argument("--num-draft-tokens", type=int, default=OPTIONS.num_draft_tokens,
                   help="the most tokens drafted per cycle (K)")
    p.add_argument("--prefill-chunk", type=int,
                   help="the most prompt tokens one prefill pass takes (rows x tokens; default: the engine's, "
                        f"{PREFILL_CHUNK}); "
                        "longer prompts are prefilled in chunks, one between two decoding cycles (0: every prompt "
                        "in one pass)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the keys and values of prompts' blocks and prefill a later prompt that starts the same "
                        "(same adapter revision, same base weights) from where they end (vLLM's automatic prefix "
                        "caching; default on; models with sliding-window attention run without it)")
    p.add_argument("--prefix-cache-bytes", type=int,
                   help="the most bytes of cached prompt blocks, least recently used evicted first (default: 1 GiB, "
                        "at most a quarter of the memory available at start)")
    p.add_argument("--gate", default=OPTIONS.gate, choices=GATES)
    p.add_argument("--draft-dtype", nargs="+", default=["auto"], choices=DRAFT_DTYPE_NAMES,
                   help="the drafter's linear layers in this dtype (int8 / int4: weight-only, the CPU); several "
                        "(e.g. float32 int8 int4; float32: the model's own precision): the gate picks one per cycle; "
                        "auto (default): float32 and the copies measured faster on this CPU, where they fit in memory")
    p.add_argument("--prompt-lookup", default="on", choices=("on", "off"),
                   help="also draft by prompt lookup (what followed an earlier occurrence of a request's last tokens "
                        "in its prompt and output; no model pass), among the drafters the gate picks from")
    p.add_argument("--prepack", default="auto", choices=tuple(PREPACK_FLAGS),
                   help="float32 linear layers on weight copies prepacked for oneDNN (the CPU; the weights' size again "
                        "in memory); auto: each layer from the tokens where its copy was measured faster on this CPU, "
                        "where the copies fit in half the memory available")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: OMP_NUM_THREADS, else the free CPUs)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on every /v1 endpoint (default: ${API_KEY_ENV}; "
                        "unset: no key)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true"),
                   help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (or ${RUNTIME_LORA_ENV}=1)")
    p.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="runtime loading reads adapters from inside these folders only (repeatable; none: anywhere)")
    p.add_argument("--lora-resolver-dir", action="append", default=[], metavar="DIR",
                   help="look up an adapter a request names and the server does not serve in DIR/<name>, or in DIR "
                        "as a Hugging Face Hub cache (models--org--repo/snapshots/...; offline) for a name org/repo, "
                        "and load it from there (repeatable; files read inside DIR only; vLLM's LoRA resolvers)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="the largest request body (413 above)")
    p.add_argument("--grammar-compile-timeout", type=float, default=GRAMMAR_COMPILE_TIMEOUT,
                   help="seconds a structured output's grammar (a JSON schema, regex, choice list, EBNF grammar, a "
                        "tool's parameters) may take to compile; longer: refused with a 400")
    p.add_argument("--max-pending-grammars", type=int, default=MAX_PENDING,
                   help="grammars waiting to be compiled at once (compilations run one at a time); a request whose "
                        "grammar would be one more is refused with a 429")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT,
                   help="on SIGTERM, seconds for the requests in flight to finish before they are ended")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked (a wrong one exits with argparse's usage error)."""
    p = parser()
    args = p.parse_args(argv)
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable()
                                         and args.api_key.strip() == args.api_key != ""):
        p.error("the API key must be printable ASCII, without spaces around it (an HTTP header carries it)")
    if args.max_body_bytes < 1 or args.shutdown_timeout < 0:
        p.error("--max-body-bytes must be >= 1 and --shutdown-timeout >= 0")
    if not 0 < args.grammar_compile_timeout <= 3600:
        p.error("--grammar-compile-timeout must be in (0, 3600] seconds")
    if args.max_pending_grammars < 1:
        p.error("--max-pending-grammars must be >= 1")
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        p.error("--prefill-chunk must be >= 0 (0: whole prompts)")
    try:
        engine_arguments(args)
    except ValueError as e:  # the option's own words; the command line spells it --option-name
        p.error(f"{e}".replace("_", "-"))
    return args


def build_server(args: argparse.Namespace) -> Server | int:
    """The Server of ``args`` (the model and adapters loaded, the engine started), or the exit code of
    what is missing (printed)."""
    from ..engine.engine import Engine
    from ..threads import set_threads

    problems = [missing(f"--lora {name}={path}", path, "adapter_config.json", "a PEFT adapter folder")
                for name, path in args.lora]
    if args.model:
        problems.insert(0, missing(f"--model {args.model}", args.model, "config.json", "a Transformers model folder"))
    problems += [f"--lora-root {root} is not a folder" for root in args.lora_root if not os.path.isdir(root)]
    problems += [f"--lora-resolver-dir {d} is not a folder" for d in args.lora_resolver_dir if not os.path.isdir(d)]
    if any(problems):
        print(f"error: {next(p for p in problems if p)}", file=sys.stderr)
        return 2
    logger.info(set_threads(args.threads))
    if args.zoo:
        from ..zoo import AssetUnavailable
        from ..zoo.assets import EXIT_UNAVAILABLE

        try:
            model, tokenizer, root, adapter_paths = load_zoo_model(args.zoo, args.adapters, args.dtype)
        except AssetUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        for name, path in args.lora:
            model.load_adapter(path, adapter_name=name)
        model_id = args.served_model_name or args.zoo
    else:  # with --max-cpu-loras, the first ones loaded; the others when a request names them
        model, tokenizer = load_model(args.model, args.lora[: args.max_cpu_loras], args.dtype)
        model_id, root, adapter_paths = args.served_model_name or args.model, args.model, {}
    adapter_paths.update(args.lora)
    for name in list(model.peft_config)[args.max_cpu_loras or len(model.peft_config):]:
        model.delete_adapter(name)  # more zoo adapters than --max-cpu-loras: loaded again on demand
    if model_id in model.peft_config:
        raise SystemExit(f"error: an adapter is named like the base model ({model_id!r}); use --served-model-name")
    engine = Engine(model, **engine_arguments(args), adapter_paths=adapter_paths,
                    lora_resolver_dirs=args.lora_resolver_dir).start()
    lora_roots = [os.path.realpath(root) for root in args.lora_root]
    return Server(engine, tokenizer, model_id, root, api_key=args.api_key,
                  runtime_updates=args.allow_runtime_lora_updating, lora_roots=lora_roots,
                  max_body_bytes=args.max_body_bytes, grammar_compile_timeout=args.grammar_compile_timeout,
                  max_pending_grammars=args.max_pending_grammars)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(args)
    if isinstance(server, int):
        return server
    engine, lora_roots = server.engine, server.lora_roots
    logger.info("serving %s with adapters %s on http://%s:%d; %s; runtime adapter loading %s", server.model_id,
                engine.adapters(), args.host, args.port, "API key required" if args.api_key else "no API key",
                f"on, from {lora_roots or 'any folder'}" if args.allow_runtime_lora_updating else "off")
    # The drain (Graceful) has ended every request when uvicorn's own graceful shutdown starts: its
    # timeout only bounds sending the last responses.
    config = uvicorn.Config(build_app(server, stop_engine_on_shutdown=True), host=args.host, port=args.port,
                            log_level=args.log_level, timeout_graceful_shutdown=5)
    Graceful(config, server, args.shutdown_timeout).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

