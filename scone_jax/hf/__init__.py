"""Hugging Face checkpoints in and out: safetensors files, a checkpoint directory, one name map per model family,
the loader that reads a checkpoint into a run's shardings, and the writer of a stock checkpoint.

Below training and serving: it imports model, sharding, runtime and data, never the packages that use it.
"""
