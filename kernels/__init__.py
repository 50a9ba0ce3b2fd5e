"""Batched multi-LoRA kernels (installed as ``hf_invisiblelora.kernels``)."""
