"""An OpenAI-compatible HTTP server on the continuous-batching engine (engine.py).

    python -m hf_invisiblelora.serve --model BASE_PATH --lora poetry=adapters/poetry --lora python=adapters/python
    python -m hf_invisiblelora.serve --zoo smollm2 [--adapters shakespeare kjv ...]

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (both with ``stream``), ``/v1/models``,
``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/health``, ``/metrics`` (Prometheus).
The ``model`` field of a request names the adapter (as in vLLM); the base model's id (or
``"__base__"``) means no adapter. Errors are OpenAI error objects with the matching status.
docs/serving.md describes the API, the options, the errors and the metrics.

Needs the ``serve`` extra (``pip install "hf-invisiblelora[serve]"``: FastAPI, uvicorn,
prometheus-client); ``--zoo`` also needs ``zoo``.

How a request runs: the handler validates it (400 / 404 before anything is queued), tokenizes the
prompt and submits an ``engine.Request`` per choice. A small thread per choice iterates the
engine's ``Handle`` and detokenizes each chunk of committed tokens as it comes (text.TextStream:
only the new tokens are decoded, with the chunk before as context; an incomplete multi-byte
character and any tail that could start a stop string are held back), then hands the new text to
the event loop (``loop.call_soon_threadsafe``). A stop string found there cancels the request (its
row is freed at the next cycle) and the text is cut at it. A client that disconnects cancels its
request. Nothing about a request is kept after it finishes.

What is guarded (docs/serving.md, "Security model"): with ``--api-key`` every ``/v1`` route wants
``Authorization: Bearer KEY``; a POST body must be ``application/json`` (a web page cannot send that
cross-site without a CORS preflight) and at most ``--max-body-bytes``; adapters load at run time only
with ``--allow-runtime-lora-updating``, from local folders inside the ``--lora-root`` folders. No
response holds an exception's text: a 500 gives a request id (``X-Request-Id``), the log the details.
SIGTERM drains: new requests get 503 while those in flight finish, for up to ``--shutdown-timeout`` s.

Modules, one concept each: ``protocol`` (error objects, request bodies, the request parameters),
``text`` (detokenization and stopping), ``bridge`` (a request's choices between the engine's
thread and asyncio), ``metrics``, ``structured`` (structured outputs' fields and grammars, tools,
the tool-call parser), ``completions`` (the completion and chat endpoints), ``admin``
(loading and unloading adapters), ``front_door`` (request ids, the drain's 503, the API key),
``app`` (the Server and the FastAPI app: its routes), ``cli`` (loading and main), ``ray_app`` (the
same server as N replicas on Ray Serve, requests routed by adapter; the extra ``ray``).
"""
