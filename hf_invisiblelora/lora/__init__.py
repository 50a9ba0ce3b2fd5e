"""LoRA in a pass: the adapter bank (bank.py: every adapter's weights stacked per layer, and the
per-pass metadata), what a LoRA layer computes from it (layer.py), the switch that turns LoRA on
and off per pass (switch.py), modules adapters train whole (saved_modules.py) and adapter folders
read safely (files.py). Builds on model/."""
