"""Loading and unloading adapters while serving (/v1/load_lora_adapter, /v1/unload_lora_adapter),
and the local-folder check that guards every load, at run time and at startup (cli.py). A part of
the Server (app.py), which holds the state."""

from __future__ import annotations

import logging
import os

from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..engine.adapters import check_name
from ..engine.engine import AdapterBusy, AdapterExists, LastAdapter, NotRunning, UnknownAdapter
from .errors import ApiError, adapter_refused, bad, show
from .protocol import json_body

logger = logging.getLogger("hf_invisiblelora.serve")


def missing(option: str, path: str, needed: str, what: str) -> str | None:
    """Why ``path`` (given as ``option``, which names it) is not the local folder it must be
    (``what``, holding the file ``needed``), or None. Checked before loading: PEFT and Transformers
    would take a missing folder for a Hub repo id."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return f"{option} is not a folder"
    if not os.path.isfile(os.path.join(folder, needed)):
        return f"{option} has no {needed} ({what})"
    return None


def success(text: str) -> Response:
    """A load's or unload's answer as vLLM's: 200 with the text as the body and no Content-Type (its
    route returns ``Response(status_code=200, content=text)``); clients look for "Success" in it."""
    return Response(text, status_code=200)


class AdapterAdmin:
    """The Server's adapter endpoints: on only with ``runtime_updates``, from inside ``lora_roots``.
    What is served is the engine's alone (Engine.adapters, adapter_paths): no copy here can disagree
    with it, whatever commands race."""

    def check_runtime_updates(self) -> None:
        if not self.runtime_updates:
            raise ApiError(404, "Loading and unloading adapters while serving is off on this server (the operator "
                           "can start it with --allow-runtime-lora-updating).", code="not_found")

    def adapter_folder(self, path: str) -> str:
        """The folder ``lora_path`` names, symlinks and ``..`` resolved. Refused (403) outside every
        --lora-root, whether it exists or not; then (400) unless it is a local PEFT adapter folder,
        checked here because PEFT takes a path it does not find for a Hub repo id and downloads it."""
        if "\x00" in path:
            raise bad("lora_path", "`lora_path` must not contain NUL characters.")
        folder = os.path.realpath(os.path.expanduser(path))
        if self.lora_roots and not any(os.path.commonpath([folder, root]) == root for root in self.lora_roots):
            raise ApiError(403, "`lora_path` is outside the folders this server loads adapters from (--lora-root).",
                           param="lora_path", code="lora_path_not_allowed")
        problem = missing("`lora_path`", folder, "adapter_config.json", "a PEFT adapter folder")
        if problem:
            raise ApiError(400, f"{problem}.", param="lora_path", code="adapter_load_failed")
        return folder

    async def load_adapter(self, request):
        self.check_runtime_updates()
        body = await json_body(request, self.max_body_bytes)
        name, path, inplace = body.get("lora_name"), body.get("lora_path"), body.get("load_inplace", False)
        for key, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise bad(key, f"`{key}` must be a non-empty string.")
        if not isinstance(inplace, bool):
            raise bad("load_inplace", "`load_inplace` must be true or false.")
        try:
            check_name(name)
        except ValueError as e:
            raise bad("lora_name", str(e)) from None
        folder = self.adapter_folder(path)
        self.check_alive()
        exists = ApiError(400, f"The name {show(name)} is already in use (an adapter or the base model).",
                          param="lora_name", code="adapter_exists")
        if name == self.model_id:
            raise exists
        try:  # the engine reads the files inside the roots and refuses what it cannot serve; a failure changes nothing
            # The path as given (/v1/models shows it so, as vLLM does); read inside the roots whatever it says
            await run_in_threadpool(self.engine.load_adapter, name, os.path.expanduser(path),
                                    roots=self.lora_roots or None, inplace=inplace)
        except Exception as e:  # noqa: BLE001 - PEFT's errors for a bad folder are of many kinds
            if isinstance(e, NotRunning):
                raise self.unavailable() from e
            if isinstance(e, AdapterExists):  # served already (without load_inplace), or the base model's name
                raise exists from e
            raise adapter_refused(e, "lora_path") from e
        logger.info("%s adapter %r from %s", "reloaded" if inplace else "loaded", name, folder)
        return success(f"Success: LoRA adapter '{name}' added successfully.")  # a reload's too, as vLLM's

    async def unload_adapter(self, request):
        self.check_runtime_updates()
        body = await json_body(request, self.max_body_bytes)
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in self.engine.adapters():
            raise ApiError(404, f"No adapter named {show(name)} is loaded.", param="lora_name", code="model_not_found")
        self.check_alive()
        try:
            await run_in_threadpool(self.engine.unload_adapter, name)
        except AdapterBusy as e:  # in use, or the last one (a PEFT model keeps one)
            raise ApiError(409, str(e), param="lora_name",
                           code="last_adapter" if isinstance(e, LastAdapter) else "adapter_in_use") from e
        except UnknownAdapter as e:  # unloaded meanwhile
            raise ApiError(404, str(e), param="lora_name", code="model_not_found") from e
        except NotRunning as e:
            raise self.unavailable() from e
        logger.info("unloaded adapter %r", name)
        return success(f"Success: LoRA adapter '{name}' removed successfully.")
