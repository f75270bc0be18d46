"""Train a model: `python -m scone_jax.main --config=configs/tiny.py --workdir=DIR`.

Every config field can be overridden, e.g. `--config.model.num_layers=2`. Rerunning the
same command resumes from the latest checkpoint in DIR.

Multi-process jobs run this same command in every process. On a Cloud TPU VM the processes
find each other from the TPU environment; elsewhere pass --coordinator_address=HOST:PORT
(process 0's address and a free port), --num_processes=N and --process_id=I.

Exit status: 0 done; 2 bad input (config, data, mismatched or damaged checkpoint, a workdir
that cannot be written or that another run owns, a failed checkpoint write, peers that never
arrived, mismatched process counts); 3 non-finite loss (last good checkpoint kept); 143 stopped
by SIGTERM after saving a checkpoint at the step reached, or during start-up before any step
(rerun to resume; 128 + 15, what a process killed by SIGTERM reports, so schedulers treat it the
same way); 130 interrupted by SIGINT (Ctrl-C): during training after saving a checkpoint at the
step reached, as SIGTERM does, and at once on a second Ctrl-C (or before the first step), keeping
the checkpoints already written. Every exit releases the workdir.
"""
from __future__ import annotations

import signal
import sys
import traceback

if __name__ == "__main__":  # Ctrl-C while the modules below load: one line, exit 130 (nothing written yet)
    from scone_jax.runtime import stop_signals

    stop_signals.stop_while_starting("scone_jax")

from absl import app, flags, logging
from ml_collections import config_flags

from scone_jax import config as config_lib
from scone_jax.runtime import job_flags, logs, parent_watch, stop_signals
from scone_jax.runtime.errors import one_line

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/tiny.py (optionally :variant).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs, config and tokenizer.")
_ALLOW_CHANGE = flags.DEFINE_list(
    "allow_config_change", [],
    "Config keys (comma-separated, e.g. data.shuffle_seed) that may differ from the checkpoint being resumed. "
    "Resuming with a changed model shape, f-gram set or data stream is refused otherwise; the refusal lists the keys.")
_JOIN = job_flags.define("Seconds to wait for all processes to join, and for the workdir's storage to answer.")
flags.adopt_module_key_flags(job_flags)  # listed by --help

EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_INTERRUPTED, EXIT_PREEMPTED = 2, 3, 130, 143


def parse_flags(argv):
    """absl flag parsing, but a misspelled --config.* key becomes a short error listing valid keys."""
    try:
        parsed = flags.FLAGS(argv)
    except Exception as e:  # noqa: BLE001 - a bad flag or a config file that fails to load: one line
        print(f"scone_jax: error: {config_lib.config_flag_error(argv) or one_line(e, 4000)}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if not flags.FLAGS["config"].present or _config_unloadable():
        print(f"scone_jax: error: {config_lib.config_flag_error(argv) or 'pass --config=configs/<name>.py'}",
              file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    return parsed


def _config_unloadable() -> bool:
    """config_flags defers a missing or broken config file's error to first use; find it now, and a key the file
    set that config_keys.py does not declare (config_flag_error loads the file again and names it)."""
    try:
        return bool(config_lib.undeclared_keys(_CONFIG.value))
    except Exception:  # noqa: BLE001 - config_flag_error names what is wrong, in one line
        return True


def main(argv):
    del argv
    parent_watch.stop_with_parent_if_asked()  # started by tools/bench_quality.py: stop (SIGTERM) when it dies
    stop_signals.install(signal.SIGINT, KeyboardInterrupt)  # Ctrl-C stops, even inside a gc callback
    logs.quiet_libraries()
    try:
        _run()
    except KeyboardInterrupt as e:  # before training, or a second Ctrl-C during it (the first saves: _run)
        if not hasattr(e, "kept_step"):  # before the loop started
            what = "interrupted (SIGINT) before the first step; the latest checkpoint, if any, is intact"
        elif e.kept_step is None:
            what = "stopped by SIGINT at once; no checkpoint was written yet"
        else:
            what = f"stopped by SIGINT at once; the checkpoint of step {e.kept_step} is kept"
        print(f"scone_jax: {what} and the workdir is free again. Rerun the same command to resume.", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def _run():
    from scone_jax.runtime import distributed, platforms, storage, write_probe as workdir
    from scone_jax.training import checkpoint, preemption, train  # after flag parsing: imports JAX

    platforms.skip_absent_tpu()  # before JAX starts its backends: no libtpu off a TPU (runtime/platforms.py)

    if not _WORKDIR.value:
        print("scone_jax: error: pass --workdir=DIR (checkpoints, logs and the tokenizer go there)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    try:
        path = storage.resolved(_WORKDIR.value)  # '../w' too: resolved once, for every store that reads it
        workdir.check_writable(path, _JOIN.startup_timeout.value)
        distributed.initialize(_JOIN.spec())
        train.run(_CONFIG.value, path, allow_config_changes=_ALLOW_CHANGE.value)
    except train.NonFiniteLossError as e:
        logging.error("%s", e)
        sys.exit(EXIT_NONFINITE)
    except preemption.Preempted as e:  # SIGTERM, or a first Ctrl-C: a checkpoint at the step reached
        logging.warning("%s", e)
        sys.exit(EXIT_INTERRUPTED if e.signal_name == "SIGINT" else EXIT_PREEMPTED)
    except preemption.StartupInterrupted as e:
        print(f"scone_jax: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except (ValueError, FileNotFoundError, distributed.DistributedStartError, workdir.WorkdirError,
            checkpoint.CheckpointWriteError) as e:
        logging.debug("%s", traceback.format_exc())
        # In a multi-process job every process stops with this line (the error may come before joining).
        distributed.exit_bad_input("scone_jax", one_line(e, limit=4000), _JOIN.spec(),
                                   joinable=not isinstance(e, distributed.DistributedStartError))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
