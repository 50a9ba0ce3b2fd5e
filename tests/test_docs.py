"""Every shell command and Python snippet of README.md and docs/ runs as written, or says why not.

Each fenced block tagged ``bash`` or ``python`` is run (from the repository's root: bash blocks
with ``bash -e``, Python blocks with this interpreter and ``-P``), unless an HTML comment right
before it (invisible on GitHub) says otherwise:

- ``<!-- doc-test: skip: REASON -->``: not run, for the reason given (installs, trains for minutes,
  benchmarks of minutes to hours, an outline of an API);
- ``<!-- doc-test: zoo MODEL ADAPTER... -->``: runs after those zoo adapters are built (the test
  trains the missing ones first, a couple of minutes each, as a user's first run does);
- ``<!-- doc-test: zoo-built MODEL ADAPTER... -->``: runs when those adapters are built already
  (skipped otherwise: more training than a test run should do);
- ``<!-- doc-test: server zoo MODEL ADAPTER... -->``: the block starts a server (the adapters built
  first); it runs in the background for the blocks after it marked ``continues``;
- ``<!-- doc-test: continues -->``: runs with the block before it (a Python block in the same
  process, after it).

Untagged blocks are text (module maps, diagrams, signatures): none may hold a command.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->\s*$")
COMMAND = re.compile(r"^\s*(\.venv/bin/|python3? |pip |curl |serve run |[A-Z_]+=\S+ python)", re.M)


@dataclass
class Block:
    file: str
    line: int
    lang: str
    code: str
    mark: str


def blocks() -> list[Block]:
    found = []
    for path in FILES:
        text = path.read_text()
        for m in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.S | re.M):
            before = text[:m.start()].rstrip("\n").splitlines()
            mark = MARK.search(before[-1]) if before else None
            code = "\n".join(line[len(m.group(1)):] for line in m.group(3).splitlines())
            found.append(Block(path.name, text[:m.start()].count("\n") + 1, m.group(2), code,
                               mark.group(1) if mark else ""))
    return found


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.lang in ("bash", "python") and not b.mark.startswith(("skip", "continues"))]


def test_untagged_blocks_hold_no_command():
    commands = [f"{b.file}:{b.line}" for b in BLOCKS if b.lang not in ("bash", "python") and COMMAND.search(b.code)]
    assert not commands, f"commands in untagged blocks (tag them bash and run them, or mark why not): {commands}"


def test_every_mark_is_understood():
    for b in BLOCKS:
        assert not b.mark or b.mark.split()[0] in ("skip:", "zoo", "zoo-built", "server", "continues"), \
            (b.file, b.line, b.mark)
        if b.mark.startswith("skip"):
            assert len(b.mark) > len("skip: ") + 10, f"{b.file}:{b.line}: say why it is not run"


def following(block: Block) -> list[Block]:
    """The blocks after ``block`` marked ``continues``."""
    i = BLOCKS.index(block)
    out = []
    for b in BLOCKS[i + 1:]:
        if not b.mark.startswith("continues"):
            break
        out.append(b)
    return out


def zoo_adapters(words: list[str], train: bool) -> None:
    """The zoo adapters ``words`` (MODEL ADAPTER...): trained if missing and ``train``, else the test skipped."""
    zoo = pytest.importorskip("hf_invisiblelora.zoo", reason="the zoo extra is not installed")
    model, adapters = words[0], words[1:]
    missing = [a for a in adapters if a not in zoo.built_adapters(model, plain_only=False)]
    if missing and not train:
        pytest.skip(f"zoo adapters {missing} of {model} are not built (more training than a test run should do)")
    try:
        for a in missing:
            zoo.adapter_path(model, a)
    except zoo.AssetUnavailable as e:
        pytest.skip(f"the zoo cannot be built here: {e}")


def run(block: Block, timeout: int = 900) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if block.lang == "python":
        cmd = [sys.executable, "-P", "-c", block.code]
    else:
        cmd = ["bash", "-e", "-c", block.code]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{block.file}:{block.line} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[f"{b.file}:{b.line}" for b in RUN])
def test_block_runs(block):
    words = block.mark.split()
    if words and words[0] in ("zoo", "zoo-built"):
        zoo_adapters(words[1:], train=words[0] == "zoo")
    rest = following(block)
    if words and words[0] == "server":
        zoo_adapters(words[2:], train=True)
        proc = subprocess.Popen(["bash", "-c", block.code], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    with urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert proc.poll() is None, f"{block.file}:{block.line}: the server exited"
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(1)
            for b in rest:
                run(b)
        finally:
            if proc.poll() is None:  # else it ended on its own: the failure above says why
                os.killpg(proc.pid, 15)
            proc.wait(60)
        return
    python = [block] + [b for b in rest if b.lang == "python"] if block.lang == "python" else [block]
    run(Block(block.file, block.line, block.lang, "\n\n".join(b.code for b in python), ""))
    for b in rest:
        if b.lang != "python" or block.lang != "python":
            run(b)
