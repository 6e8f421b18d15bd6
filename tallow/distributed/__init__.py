"""Tensor parallelism: the process group (group.py), each step's inputs from rank 0 to the
workers (step_channel.py) and the worker processes (workers.py). The Megatron shard layout is
the model's own (tallow/models/sharding.py); the model code takes a ParallelContext; without
one nothing here runs."""
