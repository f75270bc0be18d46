"""The quality study (tools/bench_quality.py, tools/plot_quality.py, docs/quality.md): its records, the
tables and figure built from them, the protocol's learning-rate rule, the checks before anything trains,
and the runs on disk. It sits above training and serving (it starts their programs); nothing imports it."""
