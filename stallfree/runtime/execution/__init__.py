"""Execution: the batch context, the sparse-attention seam, the sampler and logits processing, the step
planner and the executors that run a step (in process, or in worker processes)."""
