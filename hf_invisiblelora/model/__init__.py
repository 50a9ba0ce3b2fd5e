"""The model's passes: one walk of its modules (walk.py), the router that picks what a module
computes in a pass (routing.py) and the pass context it reads (context.py), the shared KV cache and
each row's positions and masks (cache.py, layout.py, rotary.py), the forward objects that run a pass
(forward.py), prepacked and quantized base layers (prepack.py, quantized.py), derived weight copies
(derived.py) and what is kept on a model between calls (state.py). Nothing here knows adapters'
weights or the decoding loop: lora/ and decode/ build on it."""
