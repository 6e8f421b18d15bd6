"""Paged attention backends: a torch reference (any device) and Triton kernels (CUDA)."""
