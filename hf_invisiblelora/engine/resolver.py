"""Adapters found when a request first names them (vLLM's LoRA resolver plugins): an adapter name the
engine does not serve is looked up in the operator's folders, and loaded from the first that holds
it, once however many requests name it at the same time (``resolve``; engine.py's ``Engine.resolve``).
An adapter found this way is forgotten when it is evicted (adapters.py): the next request that names
it looks it up again, so a folder removed meanwhile is a name found nowhere, not a stale path.

In each folder, in order:
- ``<folder>/<name>``: a PEFT adapter folder (``adapter_config.json``); a name with ``/`` is a
  path below the folder (vLLM's filesystem resolver);
- ``<folder>/models--<org>--<repo>/snapshots/<revision>``, for a name ``org/repo``: a Hugging Face
  Hub cache (``HF_HUB_CACHE``, offline: nothing is downloaded), at the revision ``refs/main``
  names, else its only (or newest) snapshot. Its files are links into the cache's ``blobs/``,
  which the folder's reading follows only to files inside the folder (lora/files.py).

Names are the engine's (adapters.check_name); a name with an empty, ``.`` or ``..`` part is
never looked up, and whatever is found is read inside its folder only (its real path), as files.py
reads every adapter folder a client names.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

from ..lora.files import CONFIG, read_small_file


class AdapterResolver:
    """``folders``: where unknown adapter names are looked up (see the module docstring)."""

    def __init__(self, folders):
        self.folders = [os.path.realpath(os.path.expanduser(os.fspath(f))) for f in folders]
        self._pending = {}  # adapter name -> the Future of its lookup and load
        self._lock = threading.Lock()

    def resolve(self, name: str, load) -> bool:
        """Whether ``name`` was found, and loaded by ``load(name, folder, root)``. Concurrent calls for
        one name wait for one lookup and load and share its outcome: True, False (found nowhere), or
        the load's error. Blocks for the load: call it off an event loop."""
        with self._lock:
            future, mine = self._pending.get(name), False
            if future is None:
                future, mine = self._pending.setdefault(name, concurrent.futures.Future()), True
        if mine:
            try:
                found = self.find(name)
                if found is not None:
                    load(name, *found)
                future.set_result(found is not None)
            except BaseException as e:  # noqa: BLE001 - handed to every caller waiting for this name
                future.set_exception(e)
            finally:
                with self._lock:
                    del self._pending[name]
        return future.result()

    def find(self, name: str) -> tuple[str, str] | None:
        """(the adapter's folder, the folder it was found in: the only place its files may be read),
        or None."""
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            return None
        for root in self.folders:
            for candidate in (os.path.join(root, *parts), _hub_snapshot(root, parts)):
                if candidate is not None and os.path.isfile(os.path.join(candidate, CONFIG)):
                    return candidate, root
        return None


def _hub_snapshot(root: str, parts: list[str]) -> str | None:
    """The snapshot folder of repo ``org/repo`` in the Hub cache ``root``, or None."""
    if len(parts) != 2:
        return None
    repo = os.path.join(root, f"models--{parts[0]}--{parts[1]}")
    snapshots = os.path.join(repo, "snapshots")
    ref = read_small_file(os.path.join(repo, "refs", "main"))  # never a FIFO's wait
    revision = ref.decode("utf-8", "replace").strip() if ref is not None else ""
    if revision and os.sep not in revision and revision not in (".", ".."):
        return os.path.join(snapshots, revision)
    try:
        found = [os.path.join(snapshots, s) for s in os.listdir(snapshots)]
    except OSError:
        return None
    found = [s for s in found if os.path.isdir(s)]
    return max(found, key=os.path.getmtime) if found else None
