"""PEFT's own decoder test suite with ``invisible_lora=True`` next to every generate() call.

Runs the generate-related tests of PEFT's ``tests/test_decoder_models.py`` (the version-matched
sdist from PyPI, unpacked into a cache folder; PEFT's code is never copied into this project) with
pytest in-process. Every ``PeftModel.generate`` call a test makes:

1. runs stock generate with the test's arguments; that result goes back to the test, so PEFT's own
   assertions run on stock output;
2. runs the same call with ``invisible_lora=True`` (without ``output_scores`` & co., which
   invisible_lora refuses) and compares ``sequences`` token for token (greedy calls; sampling calls
   are run but not compared: "sampled");
3. checks the model is left as it was: parameters, buffers, train/eval flags, hooks, active and
   disabled adapters, generation config, and a second stock call gives the first one's output
   (sequences and scores, from the same RNG state).

Verdicts per call: ``same``; ``near-tie`` (the first differing token was within a rounding
tolerance of stock's choice in stock's own scores); ``MISMATCH``; ``refused`` (a ValueError before
any model computation ran); ``sampled``; ``ERROR`` (any other exception, or a ValueError after
computation started); ``CHANGED`` (the model was not left as it was); ``stock-err`` (stock
generate itself raised: the exception goes to the test, nothing is compared). A call refused only because
the model is in training mode (PEFT's tests often generate right after get_peft_model, which leaves
dropout on) is also compared once more with the model put in eval mode for both runs and put back
afterwards: those calls are reported under "<test> (eval)".

The hub models of the suite are replaced by tiny random local models of the same architecture
(fixed seed); nothing is downloaded at run time except the sdist, from PyPI, when no
``--peft-tests`` is given and the cache has none. Packages PEFT's test modules import that are not
installed (datasets, diffusers, parameterized) are stubbed while they are imported.

    python -P tests/peft_suite.py [--peft-tests DIR] [--dtype float32|float64] [--json OUT]

Exits 1 on any MISMATCH, ERROR or CHANGED (``--strict-ties``: also on near ties), 2 when the suite
cannot be run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path

import pytest

# Nothing may reach a model hub: set before transformers / huggingface_hub are imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

DEFAULT_TESTS = ("mixed_adapter_batches or generate or disable_adapter or lora_layer_replication")
STATUSES = ("same", "near-tie", "MISMATCH", "refused", "sampled", "ERROR", "CHANGED", "stock-err")
FAILING = ("MISMATCH", "ERROR", "CHANGED")
# The rounding tolerance of a near tie, relative to max(1, |stock's top score|), by the model's dtype.
TIE_TOL = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}


# --------------------------------------------------------------------------------------------
# PEFT's tests: the sdist from PyPI, unpacked once into a cache folder.

def cache_dir() -> Path:
    root = os.environ.get("PEFT_SUITE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hf_invisiblelora", "peft-tests")
    return Path(root)


def locate_tests(arg: str | None, version: str) -> Path:
    """The folder holding test_decoder_models.py: from --peft-tests (the tests folder, the unpacked
    sdist, or the sdist archive), or the cached / downloaded sdist of the installed peft version."""
    if arg:
        p = Path(arg).expanduser().resolve()
        if p.is_file() and p.name.endswith((".tar.gz", ".tgz")):
            return unpack(p, cache_dir() / f"from-{p.stem}")
        for cand in (p, p / "tests"):
            if (cand / "test_decoder_models.py").is_file():
                return cand
        sub = sorted(p.glob("peft-*/tests/test_decoder_models.py"))
        if sub:
            return sub[-1].parent
        raise SystemExit(f"--peft-tests {arg}: no test_decoder_models.py there (nor in tests/, peft-*/tests/).")
    target = cache_dir() / f"peft-{version}"
    if (target / "tests" / "test_decoder_models.py").is_file():
        return target / "tests"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"peft=={version}", "--no-binary", ":all:", "--no-deps",
               "--no-build-isolation", "-q", "-d", tmp]
        print("peft_suite: fetching PEFT's tests from PyPI:", " ".join(cmd[2:]), flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:  # without build isolation pip may lack a build backend: retry with it
            cmd.remove("--no-build-isolation")
            res = subprocess.run(cmd, capture_output=True, text=True)
        archives = sorted(Path(tmp).glob("peft-*.tar.gz"))
        if res.returncode != 0 or not archives:
            raise SystemExit(f"peft_suite: could not download the peft=={version} sdist:\n{res.stdout}{res.stderr}")
        return unpack(archives[0], target)


def unpack(archive: Path, target: Path) -> Path:
    """Extract the sdist's tests/ folder (and PKG-INFO) into ``target``; returns target/tests."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent if target.parent.exists() else None))
    try:
        with tarfile.open(archive) as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts
                if len(parts) < 2 or ".." in parts or m.issym() or m.islnk():
                    continue
                if parts[1] == "tests" or parts[1:] == ("PKG-INFO",):
                    m.name = str(Path(*parts[1:]))
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(tmp), str(target))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target / "tests"


def sdist_version(tests: Path) -> str | None:
    info = tests.parent / "PKG-INFO"
    if info.is_file():
        m = re.search(r"^Version:\s*(\S+)", info.read_text(errors="replace"), re.M)
        return m.group(1) if m else None
    return None


# --------------------------------------------------------------------------------------------
# Stand-ins: stubs for missing packages, tiny local models for the hub ids.

STUBBED = ("datasets", "diffusers", "parameterized")


def missing_modules() -> list[str]:
    import importlib.util

    return [name for name in STUBBED if name not in sys.modules and importlib.util.find_spec(name) is None]


@contextlib.contextmanager
def stubs(names):
    """Empty stand-ins, while PEFT's test modules are imported (collection), for packages they import
    at module level but the selected tests never use. Transformers' modules that look for these
    packages (``is_datasets_available``) are imported first, so they see them missing."""
    import importlib.machinery

    import transformers

    for name in ("AutoModelForCausalLM", "AutoTokenizer", "DataCollatorForLanguageModeling", "DynamicCache",
                 "Trainer", "TrainingArguments"):
        getattr(transformers, name)
    import transformers.modeling_outputs  # noqa: F401

    def unavailable(what):
        def f(*a, **k):
            raise RuntimeError(f"peft_suite: {what} is a stub (the package is not installed)")
        return f

    made = {}
    for name in names:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        if name == "datasets":
            mod.load_dataset = unavailable("datasets.load_dataset")
            mod.Dataset = type("Dataset", (), {"from_dict": staticmethod(unavailable("datasets.Dataset"))})
        elif name == "diffusers":
            mod.StableDiffusionPipeline = type("StableDiffusionPipeline", (), {
                "from_pretrained": staticmethod(unavailable("diffusers.StableDiffusionPipeline"))})
        elif name == "parameterized":
            def parameterized(*a, **k):
                raise RuntimeError("peft_suite: parameterized is a stub (the package is not installed)")
            parameterized.expand = lambda *a, **k: (lambda f: f)
            mod.parameterized = parameterized
        made[name] = mod
    sys.modules.update(made)
    try:
        yield
    finally:
        for name, mod in made.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]


VOCAB = 128


def _configs():
    """Hub id -> (short name, config factory). Tiny sizes; layer counts as the tests expect (2)."""
    from transformers import (
        Gemma3TextConfig,
        GPT2Config,
        GPTJConfig,
        LlamaConfig,
        MistralConfig,
        OPTConfig,
        Qwen2Config,
    )

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    gpt2 = lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,  # noqa: E731
                              bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return {
        "peft-internal-testing/tiny-random-OPTForCausalLM": ("opt", lambda: OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, pad_token_id=1, bos_token_id=2, eos_token_id=2)),
        "peft-internal-testing/tiny-random-GPT2LMHeadModel": ("gpt2", gpt2),
        "hf-internal-testing/tiny-random-gpt2": ("gpt2", gpt2),
        "peft-internal-testing/tiny-random-GPTJForCausalLM": ("gptj", lambda: GPTJConfig(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=128,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)),
        "trl-internal-testing/tiny-random-LlamaForCausalLM": ("llama", lambda: LlamaConfig(
            **common, bos_token_id=1, eos_token_id=2)),
        "peft-internal-testing/tiny-dummy-qwen2": ("qwen2", lambda: Qwen2Config(
            **common, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 2)),
        "hf-internal-testing/tiny-random-Gemma3ForCausalLM": ("gemma3", lambda: Gemma3TextConfig(
            **{**common, "num_key_value_heads": 2}, head_dim=8, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1, bos_token_id=2)),
        "hf-internal-testing/tiny-random-MistralForCausalLM": ("mistral", lambda: MistralConfig(
            **common, bos_token_id=1, eos_token_id=2, sliding_window=None)),
    }


class StandIns:
    """Tiny random models for the hub ids, built once (seed 0, outside the tests' RNG stream) and
    handed out as copies in the requested dtype (--dtype unless the test asks for one)."""

    def __init__(self, dtype):
        import torch

        self.torch = torch
        self.dtype = dtype
        self.configs = _configs()
        self.cache = {}
        self.loaded = collections.Counter()

    def short(self, model_id) -> str:
        return self.configs[model_id][0] if model_id in self.configs else str(model_id)

    def build(self, model_id):
        torch = self.torch
        from transformers import AutoModelForCausalLM

        if model_id not in self.cache:
            config = self.configs[model_id][1]()
            config._name_or_path = model_id
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(config)
            model.eval()
            self.cache[model_id] = model
        return self.cache[model_id]

    def from_pretrained(self, model_id, *args, **kwargs):
        torch = self.torch
        key = str(model_id)
        if key not in self.configs:
            raise RuntimeError(f"peft_suite: no local stand-in for {key!r} (nothing is downloaded)")
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        if isinstance(dtype, str):
            dtype = None if dtype == "auto" else getattr(torch, dtype)
        model = copy.deepcopy(self.build(key)).to(dtype or self.dtype)
        model.eval()  # as from_pretrained returns it
        self.loaded[key] += 1
        return model


def install_stand_ins(stand_ins: StandIns) -> None:
    """Route from_pretrained of the hub ids to the stand-ins; tokenizers and configs of those ids
    are refused with a clear error (the selected tests use none)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    original = AutoModelForCausalLM.__dict__["from_pretrained"]

    def model_from_pretrained(cls, model_id, *args, **kwargs):
        if str(model_id) in stand_ins.configs:
            return stand_ins.from_pretrained(model_id, *args, **kwargs)
        if os.path.isdir(str(model_id)):  # a local folder a test saved: the real loader
            return original.__func__(cls, model_id, *args, **kwargs)
        raise RuntimeError(f"peft_suite: no local stand-in for {model_id!r} (nothing is downloaded)")

    AutoModelForCausalLM.from_pretrained = classmethod(model_from_pretrained)

    def refuse(kind, original):
        def from_pretrained(cls, model_id, *args, **kwargs):
            if str(model_id) in stand_ins.configs:
                raise RuntimeError(f"peft_suite: {kind}.from_pretrained({model_id!r}) has no stand-in (offline)")
            return original.__func__(cls, model_id, *args, **kwargs)
        return classmethod(from_pretrained)

    AutoTokenizer.from_pretrained = refuse("AutoTokenizer", AutoTokenizer.__dict__["from_pretrained"])
    AutoConfig.from_pretrained = refuse("AutoConfig", AutoConfig.__dict__["from_pretrained"])


# --------------------------------------------------------------------------------------------
# The comparison around every generate() call.

def _describe(value, limit=200):
    import torch

    if isinstance(value, torch.Tensor):
        if value.numel() <= 64:
            return f"tensor{tuple(value.shape)}={value.tolist()}"
        return f"tensor{tuple(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sequences(out):
    import torch

    return out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)


class _ComputeCounter:
    """Counts the compute calls (embeddings, matmuls, attention) a block runs: a refusal must come
    before any. A TorchFunctionMode only observes; every call runs as it would."""

    NAMES = {"embedding", "linear", "addmm", "matmul", "mm", "bmm", "baddbmm", "scaled_dot_product_attention",
             "__matmul__", "einsum", "conv1d"}

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in counter.NAMES:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _snapshot(model) -> dict:
    """What a call must leave as it found it."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    tensors = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        tensors[name] = (t.dtype, t.device, t.detach().clone())
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    gen = getattr(model, "generation_config", None)
    return {
        "tensors": tensors,
        "training": [(n, m.training) for n, m in model.named_modules()],
        "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()],
        "active": repr(getattr(model, "active_adapters", None)),
        "disabled": [(n, bool(m.disable_adapters), repr(m.active_adapters), bool(m.merged)) for n, m in layers],
        "generation_config": gen.to_json_string(use_diff=False) if gen is not None else None,
        "prepare": getattr(model.base_model, "prepare_inputs_for_generation", None),
        "modules": [n for n, _ in model.named_modules()],
        "grad": torch.is_grad_enabled(),
    }


def _diff_snapshot(a: dict, b: dict) -> list[str]:
    import torch

    out = []
    if a["modules"] != b["modules"]:
        out.append("module tree changed")
    ta, tb = a["tensors"], b["tensors"]
    if ta.keys() != tb.keys():
        added, removed = sorted(tb.keys() - ta.keys())[:3], sorted(ta.keys() - tb.keys())[:3]
        out.append(f"parameters/buffers added {added} removed {removed}")
    for k in ta.keys() & tb.keys():
        (d1, v1, x1), (d2, v2, x2) = ta[k], tb[k]
        if d1 != d2 or v1 != v2 or x1.shape != x2.shape or not torch.equal(x1, x2):
            out.append(f"tensor {k} changed")
            break
    for key in ("training", "hooks", "active", "disabled", "generation_config", "grad"):
        if a[key] != b[key]:
            if isinstance(a[key], list) and len(a[key]) == len(b[key]):
                first = next(((x, y) for x, y in zip(a[key], b[key]) if x != y), None)
                out.append(f"{key} changed: {first}")
            else:
                out.append(f"{key} changed")
    if a["prepare"] != b["prepare"]:
        out.append("base_model.prepare_inputs_for_generation changed")
    return out


def _generation_flags(model, kwargs) -> dict:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    flags = {}
    for key in ("do_sample", "num_beams", "top_k", "max_length", "max_new_tokens"):
        flags[key] = kwargs.get(key, getattr(config, key, None) if config is not None else None)
    return flags


def _first_difference(a, b):
    """(row, col) of the first differing token of two 2-D tensors (a shorter row differs at its end)."""
    rows = min(a.shape[0], b.shape[0])
    if a.shape[0] != b.shape[0]:
        return (rows, 0)
    width = min(a.shape[1], b.shape[1])
    diff = (a[:, :width] != b[:, :width])
    if diff.any():
        cols = diff.float().argmax(dim=1)
        has = diff.any(dim=1)
        # the earliest column over rows, then the first row there
        col = int(cols[has].min())
        row = int(((cols == col) & has).nonzero()[0])
        return (row, col)
    return (0, width)  # equal up to the shorter width: one is longer


class Recorder:
    """Wraps PeftModel(ForCausalLM).generate and records one verdict per call."""

    def __init__(self, stand_ins: StandIns, eval_retry: bool = True):
        self.stand_ins = stand_ins
        self.eval_retry = eval_retry
        self.entries = []
        self.current = None  # the running test's nodeid
        self.call_index = collections.Counter()
        self.local = threading.local()

    # ---- installation
    def install(self):
        from peft import PeftModel, PeftModelForCausalLM

        import hf_invisiblelora  # noqa: F401 - wraps generate of both PEFT classes (invisible_lora=True)

        for cls in (PeftModel, PeftModelForCausalLM):
            wrapped = cls.__dict__["generate"]  # hf_invisiblelora's wrapper around stock
            if not getattr(wrapped, "_invisible_lora", False):
                raise SystemExit(f"peft_suite: hf_invisiblelora did not wrap {cls.__name__}.generate")
            cls.generate = self._wrap(wrapped)

    def _wrap(self, wrapped):
        recorder = self

        @functools.wraps(wrapped)
        def generate(model, *args, **kwargs):
            if kwargs.get("invisible_lora") or getattr(recorder.local, "depth", 0):
                return wrapped(model, *args, **kwargs)
            recorder.local.depth = 1
            try:
                return recorder.call(wrapped, model, args, kwargs)
            finally:
                recorder.local.depth = 0

        generate._invisible_lora = True
        return generate

    # ---- one call
    def call(self, wrapped, model, args, kwargs):
        import torch

        rng = torch.get_rng_state()
        before = _snapshot(model)
        node = self.current or "<outside a test>"
        self.call_index[node] += 1
        entry = {"test": node, "call": self.call_index[node], "kwargs": self._kwargs(args, kwargs),
                 "dtype": str(model.dtype).replace("torch.", "")}
        try:
            stock = wrapped(model, *args, **kwargs)
        except Exception as exc:  # stock's own exception goes to the test as usual; nothing to compare
            entry.update(status="stock-err", detail=f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
            self.entries.append(entry)
            raise
        after_rng = torch.get_rng_state()
        try:
            self._compare(wrapped, model, args, kwargs, stock, rng, before, entry)
        except Exception as exc:  # noqa: BLE001 - a bug of the runner itself is reported, not hidden
            entry.update(status="ERROR", detail=f"runner: {type(exc).__name__}: {exc}",
                         where=traceback.format_exc(limit=-3))
        finally:
            torch.set_rng_state(after_rng)  # the test sees the RNG as if only stock had run
        self.entries.append(entry)
        if entry["status"] == "refused" and self.eval_retry and model.training and "eval" in entry["detail"]:
            self._eval_retry(wrapped, model, args, kwargs, rng, after_rng, node)
        return stock

    def _kwargs(self, args, kwargs):
        out = {f"arg{i}": _describe(a) for i, a in enumerate(args)}
        out.update({k: _describe(v) for k, v in kwargs.items()})
        return out

    def _compare(self, wrapped, model, args, kwargs, stock, rng, before, entry):
        import torch

        flags = _generation_flags(model, kwargs)
        sampled = bool(flags["do_sample"]) and flags.get("top_k") != 1
        dropped = [k for k in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
                   if kwargs.get(k)]
        ours_kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
        entry["dropped"] = dropped
        counter = _ComputeCounter()
        ours = error = None
        torch.set_rng_state(rng)
        try:
            with counter:
                ours = wrapped(model, *args, invisible_lora=True, **ours_kwargs)
        except ValueError as exc:
            error = exc
            if counter.count == 0:
                entry.update(status="refused", detail=" ".join(str(exc).split()))
            else:
                entry.update(status="ERROR", detail=f"ValueError after {counter.count} compute calls: {exc}",
                             where=_where(exc))
        except Exception as exc:  # noqa: BLE001
            error = exc
            entry.update(status="ERROR", detail=f"{type(exc).__name__}: {exc}", where=_where(exc))
        if error is None:
            s, o = _sequences(stock), _sequences(ours)
            if o is None or not isinstance(o, torch.Tensor):
                entry.update(status="ERROR", detail=f"invisible_lora returned {type(ours).__name__} without sequences")
            elif sampled:
                entry.update(status="sampled", detail=f"do_sample, shapes stock {tuple(s.shape)} ours {tuple(o.shape)}")
            elif s.shape == o.shape and torch.equal(s, o.to(s.device)):
                entry.update(status="same", detail=f"{tuple(s.shape)}")
            else:
                self._mismatch(wrapped, model, args, kwargs, s, o, rng, entry)
        # The model is left as it was: state, and stock once more from the same RNG state.
        changes = _diff_snapshot(before, _snapshot(model))
        torch.set_rng_state(rng)
        again = wrapped(model, *args, **kwargs)
        if not _same_output(stock, again):
            changes.append("a second stock call gives another output")
        if changes:
            entry["changed_from"] = entry["status"]
            entry["status"] = "CHANGED"
            entry["detail"] = f"{'; '.join(changes)} (the call itself: {entry['changed_from']}: {entry['detail']})"

    def _mismatch(self, wrapped, model, args, kwargs, s, o, rng, entry):
        """Where ours leaves stock, and how close stock's own scores were to a tie there."""
        import torch

        row, col = _first_difference(s, o)
        prompt_len = _prompt_length(args, kwargs)
        info = {"row": row, "col": col, "stock_shape": list(s.shape), "ours_shape": list(o.shape),
                "prompt_len": prompt_len}
        stock_tok = int(s[row, col]) if row < s.shape[0] and col < s.shape[1] else None
        ours_tok = int(o[row, col]) if row < o.shape[0] and col < o.shape[1] else None
        info.update(stock_token=stock_tok, ours_token=ours_tok,
                    stock_row=s[row].tolist() if row < s.shape[0] else None,
                    ours_row=o[row].tolist() if row < o.shape[0] else None)
        near = False
        step = col - (prompt_len or 0)
        if prompt_len is not None and step >= 0 and stock_tok is not None and ours_tok is not None:
            try:
                torch.set_rng_state(rng)
                probe = wrapped(model, *args, **{**kwargs, "return_dict_in_generate": True, "output_scores": True,
                                                 "output_logits": True})
                scores = probe.scores[step][row].double()
                logits = probe.logits[step][row].double()
                top2 = torch.topk(scores, 2)
                top = float(top2.values[0])
                gap_ours = top - float(scores[ours_tok])
                tol = TIE_TOL.get(entry["dtype"], 1e-5) * max(1.0, abs(top))
                near = 0 <= gap_ours <= tol
                info.update(step=step, stock_top2=[[int(i), float(v)] for i, v in zip(top2.indices, top2.values)],
                            score_gap_to_ours=gap_ours, tie_tol=tol,
                            logit_gap_to_ours=float(logits[stock_tok] - logits[ours_tok]))
            except Exception as exc:  # noqa: BLE001
                info["tie_probe_error"] = f"{type(exc).__name__}: {exc}"
        entry.update(status="near-tie" if near else "MISMATCH", mismatch=info,
                     detail=f"row {row} col {col} (step {step}): stock {stock_tok} ours {ours_tok}"
                            + (f", stock's score gap to ours {info['score_gap_to_ours']:.3g}"
                               if "score_gap_to_ours" in info else ""))

    def _eval_retry(self, wrapped, model, args, kwargs, rng, after_rng, node):
        """The refused training-mode call once more with the model in eval mode (both runs), then
        the train/eval flags put back."""
        import torch

        flags = [(m, m.training) for m in model.modules()]
        entry = {"test": node + " (eval)", "call": self.call_index[node], "kwargs": self._kwargs(args, kwargs),
                 "dtype": str(model.dtype).replace("torch.", "")}
        try:
            model.eval()
            before = _snapshot(model)
            torch.set_rng_state(rng)
            stock = wrapped(model, *args, **kwargs)
            self._compare(wrapped, model, args, kwargs, stock, rng, before, entry)
        except Exception as exc:  # noqa: BLE001
            entry.update(status="ERROR", detail=f"eval retry: {type(exc).__name__}: {exc}", where=_where(exc))
        finally:
            for m, t in flags:
                m.training = t
            torch.set_rng_state(after_rng)
        self.entries.append(entry)


def _same_output(a, b) -> bool:
    import torch

    sa, sb = _sequences(a), _sequences(b)
    if sa is None or sb is None or sa.shape != sb.shape or not torch.equal(sa, sb):
        return False
    for field in ("scores", "logits"):
        x, y = getattr(a, field, None), getattr(b, field, None)
        if (x is None) != (y is None):
            return False
        if x is not None and (len(x) != len(y) or not all(torch.equal(p, q) for p, q in zip(x, y))):
            return False
    return True


def _prompt_length(args, kwargs):
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    return None if ids is None else int(ids.shape[-1])


def _where(exc) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "hf_invisiblelora" in f.filename] or frames
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-4:]))


# --------------------------------------------------------------------------------------------
# pytest: selection, the current test, outcomes.

class Plugin:
    def __init__(self, recorder: Recorder, configs: str, stubbed=()):
        self.stubbed = list(stubbed)
        self.recorder = recorder
        self.configs = configs
        self.outcomes = {}
        self.reasons = {}
        self.labels = {}
        self.deselected = 0

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session):
        with stubs(self.stubbed):
            return (yield)

    def pytest_collection_modifyitems(self, session, config, items):
        from peft import LoraConfig

        keep, drop = [], []
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            cls = params.get("config_cls")
            if self.configs == "lora" and cls is not None and not issubclass(cls, LoraConfig):
                drop.append(item)
                continue
            keep.append(item)
            self.labels[item.nodeid] = self.label(item.name.split("[")[0], params)
        if drop:
            config.hook.pytest_deselected(items=drop)
            self.deselected = len(drop)
        items[:] = keep

    def label(self, name, params):
        parts = []
        if "model_id" in params:
            parts.append(self.recorder.stand_ins.short(params["model_id"]))
        cls = params.get("config_cls")
        if cls is not None:
            kw = params.get("config_kwargs") or {}
            tag = cls.__name__.replace("Config", "").lower()
            if kw.get("alora_invocation_tokens") is not None:
                tag += f"+alora{kw['alora_invocation_tokens']}"
            if kw.get("trainable_token_indices") is not None:
                tag += "+trainable_tokens"
            parts.append(tag)
        for k, v in params.items():
            if k not in ("model_id", "config_cls", "config_kwargs"):
                parts.append(f"{k}={v}")
        return f"{name}[{'|'.join(parts)}]" if parts else name

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        self.recorder.current = self.labels.get(item.nodeid, item.nodeid)
        try:
            return (yield)
        finally:
            self.recorder.current = None

    def pytest_runtest_logreport(self, report):
        label = self.labels.get(report.nodeid, report.nodeid)
        if report.when == "call" or report.outcome != "passed":
            if report.outcome == "passed" and getattr(report, "wasxfail", None):
                outcome = "xpassed"
            elif report.skipped and getattr(report, "wasxfail", None):
                outcome = "xfailed"
            else:
                outcome = report.outcome
            if self.outcomes.get(label) in (None, "passed"):
                self.outcomes[label] = outcome
                if outcome in ("failed", "skipped"):
                    self.reasons[label] = _report_reason(report)


def _report_reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return " ".join(crash.message.split())[:300]
    return " ".join(str(report.longrepr).split())[-300:]


# --------------------------------------------------------------------------------------------
# Report.

def test_name(label: str) -> str:
    """test_generate[llama|lora] (eval) -> test_generate (eval)."""
    retry = label.endswith(" (eval)")
    base = label[: -len(" (eval)")] if retry else label
    return base.split("[")[0].split("::")[-1] + (" (eval)" if retry else "")


def summarize(entries, outcomes) -> dict:
    per_test = collections.defaultdict(collections.Counter)
    for e in entries:
        per_test[test_name(e["test"])][e["status"]] += 1
    tests = collections.defaultdict(collections.Counter)
    for label, outcome in outcomes.items():
        tests[test_name(label)][outcome] += 1
    refusals = collections.Counter(e["detail"] for e in entries if e["status"] == "refused")
    return {"per_test": {k: dict(v) for k, v in sorted(per_test.items())},
            "pytest": {k: dict(v) for k, v in sorted(tests.items())},
            "refusals": dict(refusals.most_common()),
            "totals": dict(collections.Counter(e["status"] for e in entries))}


def print_report(summary, entries, plugin, args, seconds, pytest_rc, stubbed, tests_dir):
    print()
    print(f"peft_suite: PEFT tests {tests_dir} (sdist version {sdist_version(tests_dir) or '?'}), dtype {args.dtype}, "
          f"configs {args.configs}, -k {args.k!r}; {seconds:.0f} s, pytest exit {pytest_rc}; "
          f"stubbed modules: {', '.join(stubbed) or 'none'}")
    names = sorted(set(summary["per_test"]) | set(summary["pytest"]))
    width = max([len(n) for n in names] + [28])
    head = f"{'test':<{width}} " + " ".join(f"{s:>8}" for s in STATUSES) + "   pytest (stock assertions)"
    print()
    print(head)
    print("-" * len(head))
    for n in names:
        c = summary["per_test"].get(n, {})
        p = summary["pytest"].get(n, {})
        ptext = ", ".join(f"{k} {v}" for k, v in sorted(p.items())) if p else "-"
        print(f"{n:<{width}} " + " ".join(f"{c.get(s, 0):>8}" for s in STATUSES) + f"   {ptext}")
    t = summary["totals"]
    print(f"{'total':<{width}} " + " ".join(f"{t.get(s, 0):>8}" for s in STATUSES))
    print(f"({plugin.deselected} non-LoRA parametrizations deselected)" if plugin.deselected else "")

    bad = [e for e in entries if e["status"] in FAILING or e["status"] == "near-tie"]
    if bad:
        print("\nMISMATCH / near-tie / ERROR / CHANGED:")
        for e in bad:
            print(f"- {e['status']}: {e['test']} call {e['call']} ({e['dtype']}): {e['detail']}")
            print(f"    kwargs: {e['kwargs']}" + (f" (dropped for ours: {e['dropped']})" if e.get("dropped") else ""))
            if "mismatch" in e:
                m = e["mismatch"]
                print(f"    stock row: {m.get('stock_row')}\n    ours  row: {m.get('ours_row')}")
                if "stock_top2" in m:
                    print(f"    stock top-2 scores at step {m['step']}: {m['stock_top2']}, gap to ours "
                          f"{m['score_gap_to_ours']:.3g} (tie tolerance {m['tie_tol']:.1g})")
                if "tie_probe_error" in m:
                    print(f"    tie probe failed: {m['tie_probe_error']}")
            if e.get("where"):
                print(f"    at: {e['where']}")
    if summary["refusals"]:
        print("\nRefusals (count: message):")
        for msg, n in summary["refusals"].items():
            print(f"- {n}: {msg}")
    failed = {k: v for k, v in plugin.reasons.items() if plugin.outcomes.get(k) == "failed"}
    if failed:
        print("\nPEFT tests that failed (stock output, PEFT's own assertions):")
        for k, v in sorted(failed.items()):
            print(f"- {k}: {v}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peft-tests", help="PEFT's tests folder, unpacked sdist or sdist archive "
                                             "(default: the installed version's sdist from PyPI, cached)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="dtype of the stand-in models (tests that ask for one, e.g. bfloat16, get theirs)")
    parser.add_argument("-k", default=DEFAULT_TESTS, help=f"pytest -k expression (default: {DEFAULT_TESTS!r})")
    parser.add_argument("--configs", choices=("lora", "all"), default="lora",
                        help="parametrizations over ALL_CONFIGS: LoRA (LoraConfig and subclasses) or all PEFT methods")
    parser.add_argument("--no-eval-retry", action="store_true",
                        help="do not compare training-mode calls once more in eval mode")
    parser.add_argument("--strict-ties", action="store_true", help="near ties fail too")
    parser.add_argument("--json", help="write the entries and the summary here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models: 1 is fastest)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)

    import peft
    import torch

    torch.set_num_threads(args.threads)
    tests_dir = locate_tests(args.peft_tests, peft.__version__)
    found = sdist_version(tests_dir)
    if found and found != peft.__version__:
        print(f"peft_suite: warning: PEFT's tests are version {found}, installed peft is {peft.__version__}")
    stubbed = missing_modules()
    stand_ins = StandIns(getattr(torch, args.dtype))
    install_stand_ins(stand_ins)
    recorder = Recorder(stand_ins, eval_retry=not args.no_eval_retry)
    recorder.install()
    plugin = Plugin(recorder, args.configs, stubbed)

    with tempfile.TemporaryDirectory() as tmp:
        ini = Path(tmp) / "pytest.ini"
        # Our own ini: PEFT's pyproject adds coverage options and turns transformers' deprecation
        # warnings into errors, which would fail tests for reasons that are not ours to judge.
        ini.write_text("[pytest]\n")
        pytest_argv = [str(tests_dir / "test_decoder_models.py"), "-c", str(ini), "--rootdir", str(tests_dir.parent),
                       "--import-mode=importlib", "-p", "no:cacheprovider", "-q", "--no-header", "-rN",
                       "-W", "ignore::DeprecationWarning", "-W", "ignore::FutureWarning", "-W", "ignore::UserWarning",
                       "-k", args.k, *args.pytest_args]
        t = time.perf_counter()
        rc = pytest.main(pytest_argv, plugins=[plugin])
        seconds = time.perf_counter() - t

    entries = recorder.entries
    summary = summarize(entries, plugin.outcomes)
    print_report(summary, entries, plugin, args, seconds, int(rc), stubbed, tests_dir)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "dtype": args.dtype, "k": args.k, "configs": args.configs, "seconds": seconds, "pytest_exit": int(rc),
            "peft_version": peft.__version__, "tests_dir": str(tests_dir), "stubbed": stubbed,
            "summary": summary, "pytest_outcomes": plugin.outcomes, "pytest_reasons": plugin.reasons,
            "entries": entries}, indent=1, default=str))
    if int(rc) not in (0, 1):  # 1: some tests failed (reported above); otherwise pytest itself could not run
        print(f"peft_suite: pytest could not run the suite (exit {int(rc)})")
        return 2
    if not entries:
        print("peft_suite: no generate() call was seen")
        return 2
    failing = [e for e in entries if e["status"] in FAILING or (args.strict_ties and e["status"] == "near-tie")]
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
