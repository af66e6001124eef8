"""Inference: the command-line generation, the OpenAI-compatible HTTP server, quantized weights,
and Hugging Face / PEFT export (`python3 -m inference --help`). The serving engine they run
(KV-cache generation, continuous batching over a paged cache, weight sync) is `meshwork.engine`,
below train and inference, since GRPO's rollouts in the trainer run it too."""
