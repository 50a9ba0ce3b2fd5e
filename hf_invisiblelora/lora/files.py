"""A PEFT adapter folder read for a serving engine, checked before the model is touched.

    files = read_adapter(folder, model, roots, max_rank)     # refuses before the model is touched
    peft_ops.add_adapter(model, name, files)                 # PEFT's injection; on failure, undone

A server reads folders a client names, so reading is guarded as PEFT's ``load_adapter`` does not
need to be:

- every file is read inside the allowed roots at the moment it is read: the folder is opened once
  (its real path checked from the open descriptor, so a folder swapped for a symlink after a check
  is seen), and each file is opened relative to it without following symlinks, or, where roots are
  set, through one only if the file it opens is inside them (checked on the open file: a Hugging
  Face cache's snapshot links into its blobs); opened without blocking, and refused unless it is a
  regular file (a FIFO is never waited on);
- sizes are bounded before anything is allocated: the config, the rank (``r``, ``rank_pattern``)
  against ``max_rank`` (vLLM's ``--max-lora-rank``), the weights file against what an adapter of
  that rank can hold on this model, a safetensors file's shapes from its header before its data;
- values are checked: a scaling (``lora_alpha``, ``alpha_pattern``) or a weight that is not finite
  is refused (an adapter whose outputs are NaN serves nothing, and a row computed with it must not
  be a neighbour's concern either: bank.py keeps rows apart by construction);
- initializations that rewrite the base weights when an adapter is added (PiSSA, OLoRA, CorDA,
  LoftQ, EVA) are refused: the base is shared by every tenant.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import stat
from dataclasses import dataclass

import torch
from peft import LoraConfig
from torch import nn

CONFIG, SAFETENSORS, BIN = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
MAX_RANK = 256  # the default --max-lora-rank (vLLM's is 16; the zoo's adapters go to 64)
# init_lora_weights values that change the base weights when the adapter is added (PEFT's docs).
REWRITES_BASE = ("pissa", "olora", "corda", "loftq", "eva")


class AdapterRefused(ValueError):
    """The folder does not hold an adapter this server loads; the message says why (a client's 400)."""


class Unreadable(AdapterRefused):
    """The folder does not hold a PEFT adapter that can be read (files missing, malformed, or made
    for another model)."""


class OutsideRoots(AdapterRefused):
    """A file or folder is outside the folders adapters may be read from (a client's 403)."""


@dataclass
class AdapterFiles:
    config: LoraConfig
    weights: dict  # PEFT's state dict of the adapter (keys without the adapter name)


def inside(path: str, roots) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


def _open_folder(folder: str, roots) -> int:
    """A descriptor of ``folder``, checked inside ``roots`` (None: anywhere) by the path it really has
    once open (a component swapped for a symlink between a check and the open is seen here)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise Unreadable(f"the adapter folder cannot be opened ({e.strerror})") from None
    try:
        if roots is not None:
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # no /proc: the path resolved now must be the folder open
                real = os.path.realpath(folder)
                st = os.stat(real)
                if (st.st_dev, st.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                    raise OutsideRoots("the adapter folder changed while it was opened") from None
            if not inside(real, roots):
                raise OutsideRoots("the adapter folder is outside the folders this server loads adapters from")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read(fd: int, name: str, limit: int, what: str, roots=None) -> bytes | None:
    """File ``name`` of the open folder (a regular file of at most ``limit`` bytes), or None if there
    is none. Not through a symlink, unless ``roots`` are set and the file it leads to is inside them
    (``_open_link``). Opened without blocking: a FIFO or a device is refused, never waited on."""
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise Unreadable(f"{name} cannot be opened ({e.strerror})") from None
        f = _open_link(fd, name, roots)
    return _regular_contents(f, name, limit, what)


def _regular_contents(f: int, name: str, limit: int, what: str) -> bytes:
    """The contents of the open descriptor ``f`` (closed after), a regular file of at most ``limit`` bytes."""
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode):  # a folder, a FIFO, a device: nothing an adapter is made of
            raise Unreadable(f"{name} is not a regular file")
        if st.st_size > limit:
            raise AdapterRefused(f"{name} is {st.st_size} bytes, more than {what} can need ({limit} bytes)")
    except BaseException:
        os.close(f)
        raise
    with os.fdopen(f, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise Unreadable(f"{name} grew past {limit} bytes while it was read")
    return data


def read_small_file(path: str, limit: int = 4096) -> bytes | None:
    """The contents of the regular file ``path`` (at most ``limit`` bytes), or None if it is missing,
    not a regular file, or larger; opened without blocking, so a FIFO never stalls the caller (the
    resolver's read of a Hub cache's ``refs/main``)."""
    try:
        f = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return _regular_contents(f, os.path.basename(path), limit, "a small file")
    except AdapterRefused:
        return None


def _open_link(fd: int, name: str, roots) -> int:
    """File ``name`` of the open folder, a symlink, opened through it only where ``roots`` are set and
    the file it opens is inside them, checked on the open file itself (a Hugging Face Hub cache keeps
    a snapshot's files as links into its ``blobs/``: resolver.py)."""
    refused = OutsideRoots(f"{name} is a symlink to a file outside the folders this server loads adapters from; "
                           "adapters' files are read only inside them")
    if roots is None:
        raise refused
    try:
        f = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=fd)
    except OSError as e:
        raise Unreadable(f"{name} is a symlink that cannot be opened ({e.strerror})") from None
    try:
        real = os.readlink(f"/proc/self/fd/{f}")
    except OSError:
        real = None  # no /proc: where it leads cannot be told from the open file
    if real is None or not inside(real, roots):
        os.close(f)
        raise refused
    return f


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _config(raw: bytes, max_rank: int) -> LoraConfig:
    """The LoraConfig of ``adapter_config.json``, refused before anything is allocated for it if its
    rank passes ``max_rank``, a scaling is not finite, or its initialization rewrites the base."""
    try:
        values = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise Unreadable(f"{CONFIG} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(values, dict):
        raise Unreadable(f"{CONFIG} must hold a JSON object")
    if values.get("peft_type", "LORA") != "LORA":
        raise AdapterRefused(f"the adapter is a {values.get('peft_type')!r} adapter; this server serves LoRA")
    values.pop("runtime_config", None)
    ranks = {"r": values.get("r", 8), **{f"rank_pattern[{k!r}]": v for k, v in (values.get("rank_pattern") or {}).items()}}
    for where, r in ranks.items():
        if not (isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= max_rank):
            raise AdapterRefused(f"the adapter's rank {where} = {r!r} is not in [1, {max_rank}] (--max-lora-rank)")
    alphas = {"lora_alpha": values.get("lora_alpha", 8),
              **{f"alpha_pattern[{k!r}]": v for k, v in (values.get("alpha_pattern") or {}).items()}}
    for where, a in alphas.items():
        if not _finite(a):
            raise AdapterRefused(f"the adapter's scaling {where} = {a!r} is not a finite number")
    init = values.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(REWRITES_BASE):
        raise AdapterRefused(f"init_lora_weights={init!r} rewrites the base model's weights when the adapter is added; "
                             "convert the adapter to a plain LoRA adapter first")
    try:
        config = LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**values))
    except (TypeError, ValueError) as e:
        raise Unreadable(f"{CONFIG} is not a LoRA config PEFT accepts: {e}") from None
    config.inference_mode = True
    return config


def weights_limit(model, config: LoraConfig) -> int:
    """The most bytes an adapter with ``config`` can hold on ``model`` (float64 at most): LoRA A and B
    at its largest rank on every linear and embedding layer, DoRA magnitudes, and a copy of each
    module its ``modules_to_save`` names."""
    r = max([config.r, *(config.rank_pattern or {}).values()])
    saved = tuple(config.modules_to_save or ())
    total = 0
    for name, m in model.get_base_model().named_modules():
        if isinstance(m, nn.Linear):
            total += r * (m.in_features + m.out_features) + m.out_features
        elif isinstance(m, nn.Embedding):
            total += r * (m.num_embeddings + m.embedding_dim)
        if saved and any(name == s or name.endswith("." + s) for s in saved):
            total += sum(p.numel() for p in m.parameters())
    return 8 * total + (1 << 20)  # and the file's own framing


def _check_header(raw: bytes, max_rank: int) -> None:
    """A safetensors file's header (shapes, before its data is made tensors): LoRA matrices of rank
    <= ``max_rank``, within the file."""
    if len(raw) < 8:
        raise Unreadable(f"{SAFETENSORS} is truncated")
    n = int.from_bytes(raw[:8], "little")
    if n > min(MAX_HEADER_BYTES, len(raw) - 8):
        raise Unreadable(f"{SAFETENSORS} has a header of {n} bytes, past its end or its bound")
    try:
        header = json.loads(raw[8:8 + n])
    except (ValueError, RecursionError):
        raise Unreadable(f"{SAFETENSORS} has no valid header") from None
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list):
            raise Unreadable(f"{SAFETENSORS} has no shape for {key!r}")
        rank = shape[0] if ".lora_A." in key or "lora_embedding_A" in key else \
            shape[1] if (".lora_B." in key or "lora_embedding_B" in key) and len(shape) > 1 else None
        if rank is not None and not (isinstance(rank, int) and rank <= max_rank):
            raise AdapterRefused(f"{SAFETENSORS} holds {key!r} of rank {rank}, more than {max_rank} (--max-lora-rank)")


def _weights(fd: int, model, config: LoraConfig, max_rank: int, roots=None) -> dict:
    limit = weights_limit(model, config)
    raw = _read(fd, SAFETENSORS, limit, "an adapter of this rank on this model", roots)
    if raw is not None:
        _check_header(raw, max_rank)
        from safetensors.torch import load

        try:
            return load(raw)
        except Exception as e:  # noqa: BLE001 - safetensors' errors for a malformed file are of several kinds
            raise Unreadable(f"{SAFETENSORS} cannot be read: {e}") from None
    raw = _read(fd, BIN, limit, "an adapter of this rank on this model", roots)
    if raw is None:
        raise Unreadable(f"the folder has neither {SAFETENSORS} nor {BIN}")
    try:
        weights = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a malformed or unsafe pickle
        raise Unreadable(f"{BIN} cannot be read as weights: {type(e).__name__}") from None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise Unreadable(f"{BIN} does not hold a dict of tensors")
    return weights


def read_adapter(folder: str, model, roots=None, max_rank: int = MAX_RANK) -> AdapterFiles:
    """The adapter in ``folder`` (see the module docstring), read and checked; ``roots``: the real
    paths files may be read under (None: anywhere). Raises AdapterRefused (OutsideRoots) saying why."""
    fd = _open_folder(os.path.realpath(os.path.expanduser(folder)) if roots is not None else folder, roots)
    try:
        raw = _read(fd, CONFIG, MAX_CONFIG_BYTES, "a config", roots)
        if raw is None:
            raise Unreadable(f"the folder has no {CONFIG} (it is not a PEFT adapter folder)")
        config = _config(raw, max_rank)
        weights = _weights(fd, model, config, max_rank, roots)
    finally:
        os.close(fd)
    for key, t in weights.items():
        if key.count(".lora_A.") + key.count(".lora_B.") and t.dim() == 2 and \
                (t.shape[0] if ".lora_A." in key else t.shape[1]) > max_rank:
            raise AdapterRefused(f"the adapter's {key!r} has rank {t.shape}, more than {max_rank} (--max-lora-rank)")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise AdapterRefused(f"the adapter's weight {key!r} holds values that are not finite (NaN or Inf)")
    return AdapterFiles(config, weights)
