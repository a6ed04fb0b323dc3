"""Daemon process services: GPU memory governor, instance lock, paths, logging and signals (no tensors)."""
