"""llama.cpp side by side: its server against ours on the same weights and adapters (CPU).

llama.cpp is the fastest CPU engine with per-request LoRA; this measures it next to
`generate(invisible_lora=True)` and stock PEFT in one run, same machine, same threads:
  build   llama-server from llama-cpp-python's PyPI sdist (it vendors llama.cpp's source; no
          network at build time: the web UI download is off), ~15-40 min on 2 cores, cached;
  convert the zoo's base model to an f32 GGUF (convert_hf_to_gguf.py) and each adapter to a GGUF
          LoRA (convert_lora_to_gguf.py), cached;
  bench   start llama-server with every adapter preloaded (``--lora``, scale 0 by default) and
          one slot per row, send each row's request with its adapter at scale 1 (the per-request
          ``lora`` field), rows at once; tokens/s = completion tokens / wall time of the batch,
          prefill included, as for ours (greedy, the same prompts, ``max_tokens`` = new tokens,
          EOS ignored on both sides so every row makes all of its tokens).

    python -P benchmarks/bench_llama_cpp.py --batches 1 8 --adapter-counts 1 4 --repeats 3

Needs the bench extra (`pip install -e ".[bench]"`: llama.cpp's converter imports sentencepiece). The sdist comes from PyPI (``pip download --no-binary :all: llama-cpp-python``) unless --sdist
names one. Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import torch

import hf_invisiblelora  # noqa: F401  (generate(invisible_lora=True))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py, under python -P too
from common import machine
from hf_invisiblelora.zoo import assets, load_zoo, mixed_prompts, zoo_dir

CACHE = assets.home() / "llama_cpp"


def source(sdist: str | None) -> Path:
    """llama.cpp's source tree, unpacked from llama-cpp-python's sdist (downloaded once)."""
    if sdist is None:
        found = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
        if not found:
            CACHE.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--dest", str(CACHE), "llama-cpp-python"], check=True)
            found = sorted(CACHE.glob("llama_cpp_python-*.tar.gz"))
        sdist = str(found[-1])
    top = CACHE / Path(sdist).name.removesuffix(".tar.gz")
    if not top.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    return top / "vendor" / "llama.cpp"


def build(src: Path, jobs: int) -> Path:
    """llama-server, built once (Release, native ISA, no curl / OpenSSL / web UI download)."""
    out = src / "build"
    binary = out / "bin" / "llama-server"
    if binary.exists():
        return binary
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON"], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-server", "-j", str(jobs)], check=True)
    return binary



def convert(src: Path, base: Path, adapters: dict[str, Path]) -> tuple[Path, dict[str, Path]]:
    """The base model as an f32 GGUF and each adapter as a GGUF LoRA (llama.cpp's converters, cached)."""
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    out = CACHE / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    model = out / f"{base.name}-f32.gguf"
    if not model.exists():
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(base), "--outtype", "f32",
                        "--outfile", str(model)], check=True, env=env)
    loras = {}
    for name, folder in adapters.items():
        loras[name] = out / f"{base.name}-{name}-f32.gguf"
        if not loras[name].exists():
            subprocess.run([sys.executable, str(src / "convert_lora_to_gguf.py"), str(folder), "--base", str(base),
                            "--outtype", "f32", "--outfile", str(loras[name])], check=True, env=env)
    return model, loras


def peft_scale(folder: Path) -> float:
    """The request scale that makes llama.cpp's LoRA scaling (alpha / r) PEFT's: sqrt(r) for rsLoRA
    (alpha / sqrt(r)), else 1."""
    config = json.loads((folder / "adapter_config.json").read_text())
    return config["r"] ** 0.5 if config.get("use_rslora") else 1.0


class LlamaServer:
    """llama-server on 127.0.0.1 with the adapters preloaded at scale 0 and ``slots`` parallel slots."""

    def __init__(self, binary: Path, model: Path, loras: list[Path], slots: int, context: int, threads: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "-np", str(slots), "-c", str(context * slots), "--lora-init-without-apply",
               "--no-webui"]
        for lora in loras:
            cmd += ["--lora", str(lora)]
        self.log = open(CACHE / "llama-server.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
            if self.proc.poll() is not None:
                break
        self.close()
        raise RuntimeError(f"llama-server did not start; see {CACHE / 'llama-server.log'}")

    def complete(self, ids: list[int], lora: int, scale: float, new: int) -> list[int]:
        body = dict(prompt=ids, n_predict=new, temperature=0.0, top_k=1, ignore_eos=True, cache_prompt=False,
                    lora=[dict(id=lora, scale=scale)], return_tokens=True, samplers=["top_k"])
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["tokens"]

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def batch_on_llama(server, prompts, lora_ids, scales, new):
    """Every row's request at once (one thread each): (seconds for the batch, tokens per row)."""
    from concurrent.futures import ThreadPoolExecutor

    t = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        out = list(pool.map(lambda r: server.complete(prompts[r], lora_ids[r], scales[r], new), range(len(prompts))))
    return time.perf_counter() - t, out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--adapter-counts", nargs="+", type=int, default=[1, 4])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sdist", help="llama-cpp-python's sdist (default: downloaded from PyPI once)")
    p.add_argument("--jobs", type=int, default=os.cpu_count(), help="build jobs")
    p.add_argument("--out", default="benchmarks/results/llama_cpp.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    src = source(args.sdist)
    binary = build(src, args.jobs)
    model, tok, names = load_zoo("smollm2")
    names = names[:max(args.adapter_counts)]
    folders = {n: zoo_dir("smollm2") / n for n in names}
    gguf, loras = convert(src, assets.prepare("smollm2"), folders)
    scales = {n: peft_scale(f) for n, f in folders.items()}
    server = LlamaServer(binary, gguf, [loras[n] for n in names], max(args.batches), args.prompt_tokens + args.new_tokens + 8,
                         args.threads)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               pad_token_id=tok.pad_token_id)
    ways = {"stock PEFT": {}, "ours, gate never": dict(invisible_lora=True, gate="never"),
            "ours, default": dict(invisible_lora=True)}
    results = []
    print(f"CPU {machine()}; {args.threads} threads on both sides; {args.prompt_tokens}-token prompts, "
          f"{args.new_tokens} new tokens (EOS ignored), greedy; tokens/s, medians of {args.repeats}")
    print("| batch | adapters | llama.cpp | " + " | ".join(ways) + " | ours default / llama.cpp | same tokens as llama.cpp |")
    print("|---" * (5 + len(ways)) + "|")
    try:
        for batch in args.batches:
            for a in args.adapter_counts:
                if a > batch:
                    continue
                prompts, rows = mixed_prompts("smollm2", tok, names[:a], -(-batch // a), args.prompt_tokens)
                prompts, rows = prompts[:batch], rows[:batch]
                tok.padding_side = "left"
                enc = tok(prompts, return_tensors="pt", padding=True)
                ids = [tok(x)["input_ids"] for x in prompts]
                runs = {w: [] for w in ["llama.cpp", *ways]}
                outputs = {}
                for rep in range(args.repeats + 1):  # the first round warms up, untimed
                    s, out = batch_on_llama(server, ids, [names.index(r) for r in rows], [scales[r] for r in rows],
                                            args.new_tokens)
                    outputs["llama.cpp"] = out
                    runs["llama.cpp"].append(sum(map(len, out)) / s)
                    for w, kw in ways.items():
                        t = time.perf_counter()
                        with torch.no_grad():
                            o = model.generate(**enc, adapter_names=rows, **gen, **kw)
                        s = time.perf_counter() - t
                        outputs[w] = o[:, enc["input_ids"].shape[1]:].tolist()
                        runs[w].append(o[:, enc["input_ids"].shape[1]:].numel() / s)
                med = {w: statistics.median(v[1:]) for w, v in runs.items()}
                same = sum(x[:len(y)] == y for x, y in zip(outputs["ours, default"], outputs["llama.cpp"]))
                assert outputs["ours, default"] == outputs["stock PEFT"], "ours differs from stock PEFT"
                results.append(dict(batch=batch, adapters=a, tokens_per_s=med, same_as_llama_cpp=same))
                print(f"| {batch} | {a} | {med['llama.cpp']:.1f} | " + " | ".join(f"{med[w]:.1f}" for w in ways)
                      + f" | {med['ours, default'] / med['llama.cpp']:.2f}x | {same} of {batch} rows |", flush=True)
    finally:
        server.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command="python benchmarks/bench_llama_cpp.py " + " ".join(sys.argv[1:] if argv is None else argv),
                                   cpu=machine(), threads=args.threads, llama_cpp=src.parent.parent.name,
                                   results=results), indent=1))


if __name__ == "__main__":
    main()
