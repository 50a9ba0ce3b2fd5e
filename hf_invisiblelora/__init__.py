"""hf-invisiblelora: lossless fast multi-LoRA decoding for Transformers + PEFT."""
