"""Tensor parallelism: how a model splits across ranks, their group's collectives, rank 0's runner and the workers."""
