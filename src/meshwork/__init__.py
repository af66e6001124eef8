"""meshwork's engine room: config, data, checkpoints, metrics, hardware and FLOP math."""
