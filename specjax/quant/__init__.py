"""Quantized weights: formats (`QMatrix`), the ops models call, GGUF repacking, quantizing a model's params."""
