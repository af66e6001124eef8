"""Run plumbing: Orbax checkpoints (verified, resumable), the metrics file, the goodput clock."""
