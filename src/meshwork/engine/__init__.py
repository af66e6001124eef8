"""The serving engine: what both the trainer (GRPO's rollouts, train/rollouts.py) and inference (the
HTTP server, `python3 -m inference lm`) run, so it lives below both (train and inference never
import each other).

- generate.py: `Generator`, a model ready to generate: prefill, decode step, log-probabilities.
- serving.py: `Server`, continuous batching over a paged KV cache, prefix caching, chunked prefill.
- kv_cache.py, page_pool.py: the contiguous and paged caches, the reference-counted page pool.
- speculative.py: speculative decoding (a draft proposes, the target verifies k tokens in one forward).
- sampling.py, validation.py: sampling settings and their arrays; what a request may ask.
- weight_sync.py: a trainer's sharded parameters into the engine's layout, on device.
"""
