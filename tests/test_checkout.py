"""The usual commands work from the checkout's folder, with and without ``-P``, and print no warning a user
cannot act on.

Without ``-P`` the folder is on ``sys.path`` first: the checkout's ``hf_invisiblelora`` is imported, and its
top-level ``kernels/`` folder must not shadow Hugging Face's ``kernels`` package, which Transformers imports
while loading ``modeling_utils``. The folder has no ``__init__.py`` (a namespace portion, which a regular
package later on ``sys.path`` beats); ``hf_invisiblelora`` maps it in as ``hf_invisiblelora.kernels``.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IMPORTS = ("import hf_invisiblelora, kernels, transformers.modeling_utils; "
           "print(hf_invisiblelora.__file__); print(list(hf_invisiblelora.kernels.__path__)); print(kernels.__file__)")
COMMANDS = {
    "imports": ["-c", IMPORTS],
    "serve": ["-m", "hf_invisiblelora.serve", "--help"],
    "pytest": ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py"],
}


def test_no_top_level_package_named_kernels():
    assert (ROOT / "kernels" / "meta.py").is_file()
    assert not (ROOT / "kernels" / "__init__.py").exists(), "it would shadow Hugging Face's kernels package"


@pytest.mark.parametrize("safe_path", [False, True], ids=["no -P", "-P"])
@pytest.mark.parametrize("command", COMMANDS)
def test_runs_from_the_checkout(command, safe_path):
    cmd = [sys.executable, *(["-P"] if safe_path else []), *COMMANDS[command]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if command == "imports":
        package, kernels_path, hf_kernels = done.stdout.splitlines()
        if not safe_path:  # the checkout's own source (with -P: the installed package, or the checkout if editable)
            assert Path(package).parent.parent == ROOT and str(ROOT / "kernels") in kernels_path
        assert Path(hf_kernels).parent != ROOT / "kernels"  # Hugging Face's (a .venv may live in the checkout)
    elif command == "serve":
        assert done.stdout.startswith("usage: python -m hf_invisiblelora.serve")
    else:
        assert "tests collected" in done.stdout


def test_pefts_deprecated_property_read_is_silenced_and_nothing_else():
    """PEFT reads Transformers' deprecated ``is_gradient_checkpointing`` whenever it wraps a model;
    ``import hf_invisiblelora`` silences that FutureWarning (the Usage code, the server) and no other."""
    code = ("import warnings, hf_invisiblelora\n"
            "from peft import LoraConfig, get_peft_model\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
            "                     num_attention_heads=4, num_key_value_heads=2)\n"
            "get_peft_model(LlamaForCausalLM(config), LoraConfig(target_modules=['q_proj']))\n"
            "warnings.warn('another deprecation', FutureWarning)\n")
    done = subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is_gradient_checkpointing" not in done.stderr and "FutureWarning: another deprecation" in done.stderr
