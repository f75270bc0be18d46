"""The tests' small config as a config file, for runs of `python -m scone_jax.main` in a subprocess.

`--config=tests/small_config.py:TOKENIZER_PATH` reuses a tokenizer trained once per test session.
"""
from tests.common import small_config


def get_config(arg=None):
    config = small_config()
    if arg:
        config.data.tokenizer_path = arg
    return config
