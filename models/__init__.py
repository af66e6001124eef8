"""Flax NNX models. They name logical axes only; sharding/rules.py maps them to a mesh."""
