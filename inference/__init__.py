"""Inference (KV-cache generation, batching, quantization): built by issue #7."""
