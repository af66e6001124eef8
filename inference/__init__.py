"""Inference: KV-cache generation, continuous batching over a paged cache, the OpenAI-compatible
HTTP server, quantized weights, and Hugging Face / PEFT export (`python3 -m inference --help`)."""
