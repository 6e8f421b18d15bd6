"""Tensor parallelism: process group (group.py), Megatron shard layout (sharding.py), each
step's inputs from rank 0 to the workers (step_channel.py), and the worker processes
(workers.py). The model code takes a ParallelContext; without one nothing here runs."""
