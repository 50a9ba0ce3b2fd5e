"""The continuous-batching serving engine (engine.py): requests (request.py) join free rows
between cycles (scheduler.py), their tokens are delivered as cycles commit them (rows.py), and
adapters are loaded, evicted and loaded again within bounds (adapters.py). Builds on decode/;
serving/ puts HTTP in front of it.

    from hf_invisiblelora.engine import Engine, Request
"""

from .engine import *  # noqa: F403 - the engine's public names
from .engine import __all__  # noqa: F401
