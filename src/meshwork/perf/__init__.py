"""The performance model, pure Python: accelerator table, FLOP counts, roofline, memory and
communication per strategy, the layout planner, failure and checkpoint-interval arithmetic."""
