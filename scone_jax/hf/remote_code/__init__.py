"""The `trust_remote_code` model that `python -m scone_jax.serving.export --format=hf` copies into an export of a SCONE
run (or of any run whose input a stock family cannot express): configuration_scone.py, modeling_scone.py and
scone_fgrams.py, listed in the export's config.json `auto_map`. They run on a user's machine with transformers, torch
and numpy alone, so they import nothing from scone_jax (tests/test_hf_scone_export.py checks it) and never reach the
network. serving/hf_remote.py writes the files they read."""
