"""meshwork: how foundation models are sharded, trained, checkpointed, fine-tuned and served, in JAX.

One import name; layers that import one way only (tests/test_architecture.py):

    meshwork.sharding     meshes, the logical-axis rules, collectives, pipeline schedules, HLO readers (jax only)
    engine room           meshwork.config (+ config_sections), meshwork.partitioning (logical names ->
                          NamedShardings), meshwork.run (checkpoints, metrics, goodput clock),
                          meshwork.data, meshwork.perf (performance model and planner),
                          meshwork.kernels (Pallas), meshwork.diffusion, meshwork.evaluation
    meshwork.models       Flax NNX modules, model building, quantized and sparse weight formats, PEFT
    meshwork.train        the trainer (python3 -m meshwork.train), planner and plot CLIs
    meshwork.inference    generation, KV caches, serving, Hugging Face import/export (python3 -m meshwork.inference)
"""
