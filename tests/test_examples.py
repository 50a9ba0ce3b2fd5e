"""examples/finetune_and_serve: the notebook runs headless on a tiny random model, and it holds the
same cells as the script version.

The notebook is generated from the script (cells split on ``# %%`` lines):
    python tests/test_examples.py
"""

import re
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPT = EXAMPLES / "finetune_and_serve.py"
NOTEBOOK = EXAMPLES / "finetune_and_serve.ipynb"


def script_cells(text: str) -> list[tuple[str, str]]:
    """(cell_type, source) of each ``# %%`` section; markdown sections lose their ``# `` prefixes."""
    cells = []
    for chunk in re.split(r"^# %%", text, flags=re.M)[1:]:
        header, _, body = chunk.partition("\n")
        if "[markdown]" in header:
            cells.append(("markdown", "\n".join(line[2:] for line in body.strip().splitlines())))
        else:
            cells.append(("code", body.strip()))
    return cells


def build_notebook() -> nbformat.NotebookNode:
    make = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
    nb = nbformat.v4.new_notebook(cells=[make[kind](src) for kind, src in script_cells(SCRIPT.read_text())])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def test_notebook_has_the_script_cells():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert [(c.cell_type, c.source) for c in nb.cells] == script_cells(SCRIPT.read_text()), (
        "notebook and script differ: regenerate with `python tests/test_examples.py`"
    )


def test_notebook_runs_headless_on_a_tiny_model(monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("HF_INVISIBLELORA_EXAMPLE_TINY", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "same text as standard generate" in text
    assert "['shakespeare', 'python_code']" in text
    assert "acceptance" in text


def test_demo_counts_new_tokens_up_to_the_first_eos():
    import torch

    from hf_invisiblelora.zoo.demo import new_tokens

    sequences = torch.tensor([[5, 5, 7, 1, 0, 0], [0, 5, 8, 9, 9, 9]])
    assert new_tokens(sequences, 2, {1}) == [[7, 1], [8, 9, 9, 9]]


if __name__ == "__main__":
    nbformat.write(build_notebook(), NOTEBOOK)
    print("wrote", NOTEBOOK)
