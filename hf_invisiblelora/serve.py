"""``python -m hf_invisiblelora.serve``: the OpenAI-compatible server (hf_invisiblelora.serving;
docs/serving.md has its options)."""

import sys

from .serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
