"""scone_jax: train, export and evaluate SCONE language models with JAX."""
__version__ = "0.1.0"
