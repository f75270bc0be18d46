"""Turn a local Hugging Face checkpoint into a run at step 0, which `scone_jax.main` fine-tunes and
`scone_jax.serving.export` exports like any run.

  python tools/import_hf.py --hf_dir=/ckpt/Qwen3-0.6B-Base --workdir=/tmp/ft
  python tools/import_hf.py --hf_dir=DIR --workdir=W --config=configs/finetune_hf.py --config.scone.enabled=True
  python -m scone_jax.main --config=configs/finetune_hf.py --config.model.init_from_hf=DIR --workdir=W   # resumes

The run's config is --config (configs/finetune_hf.py by default) with model.init_from_hf=--hf_dir: its model section
and tokenizer are derived from the checkpoint (scone_jax/hf/derive.py), its decoder's parameters are read from the
safetensors files straight into their shardings (scone_jax/hf/load.py), and the state is saved as the checkpoint of
step 0 exactly as training saves one (training/run.py save_initial_state). Pass `scone_jax.main` the same config
(the same --config and --config.* flags, with --config.model.init_from_hf=DIR) and it resumes that checkpoint.

Every check of the checkpoint (config.json, weights, each tensor's name, shape and dtype, the tokenizer against the
embedding's rows) and of the config runs before anything is written or any device is used: bad input is one line,
exit status 2. A workdir that already holds a checkpoint is refused (it is a run already), and so is one that is
--hf_dir itself or lies inside it, or holds a config.json a run did not write (runtime/outputs.py: nothing of the
user's is overwritten). On a pod run the same
command on every host (like training: --coordinator_address, --num_processes, --process_id elsewhere); each host
reads only the blocks its devices hold; when one host stops on bad input (its copy of the checkpoint missing), every
host stops with its line (runtime/distributed.py).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
if __name__ == "__main__":  # Ctrl-C while the modules below load: one line, exit 130 (nothing written yet)
    from scone_jax.runtime import stop_signals

    stop_signals.stop_while_starting("import_hf")

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from scone_jax import config as config_lib  # noqa: E402
from scone_jax.runtime import job_flags, tool_main  # noqa: E402
from scone_jax.runtime.errors import one_line  # noqa: E402

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                               "finetune_hf.py")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "A local Hugging Face checkpoint directory (config.json, "
                              "model.safetensors or shards with model.safetensors.index.json, tokenizer.json).")
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (must hold no checkpoint yet).")


def _flag_error(argv) -> str | None:
    """Why --config / --config.KEY flags do not parse, in one line; the default config file when none is given."""
    if not any(a.startswith("--config=") for a in argv):
        argv = [*argv, f"--config={_DEFAULT_CONFIG}"]
    return config_lib.config_flag_error(argv)


try:  # config_flags applies --config.KEY=VALUE to the default file here, at definition
    _CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "The run's config file[:variant]; its model "
                                              "keys are derived from the checkpoint.", lock_config=True)
except (AttributeError, KeyError, ValueError) as _error:
    print(f"import_hf: error: {_flag_error(sys.argv) or one_line(_error)}", file=sys.stderr)
    sys.exit(tool_main.EXIT_BAD_INPUT)
_JOIN = job_flags.define()
flags.adopt_module_key_flags(job_flags)


def prepare(config, hf_dir: str):
    """`config` started from `hf_dir`: derived from it and validated (hf/derive.py), nothing written, no device used;
    the opened checkpoint."""
    from scone_jax.hf import derive

    derive.require_local(hf_dir, "--hf_dir")
    set_dir = config.model.init_from_hf
    if set_dir and os.path.abspath(set_dir) != os.path.abspath(hf_dir):
        raise ValueError(f"--hf_dir={hf_dir} but the config sets model.init_from_hf={set_dir!r}. Fix: pass one of "
                         "them.")
    config.model.init_from_hf = hf_dir
    checkpoint = derive.apply(config)
    config_lib.validate(config)
    return checkpoint


def saved_steps(workdir: str) -> list[int]:
    """The checkpoint steps under <workdir>/checkpoints (local or gs://), read without creating anything."""
    from scone_jax.runtime import storage, workdir as workdir_layout

    keys = storage.open_store(workdir_layout.path(workdir, workdir_layout.CHECKPOINTS)).list().result()
    return sorted({int(k.decode().split("/")[0]) for k in keys if k.decode().split("/")[0].isdigit()})


def import_checkpoint(config, workdir: str) -> None:
    """Save the run of the prepared `config` in `workdir` at step 0 (refused if the workdir holds a checkpoint)."""
    import jax

    from scone_jax import sharding
    from scone_jax.runtime import ownership, write_probe
    from scone_jax.training import run as run_lib

    config_lib.validate_batch_split(config, sharding.num_batch_shards(sharding.make_mesh(config.mesh)))
    steps = saved_steps(workdir)
    if steps:
        raise ValueError(f"{workdir} already holds a run (checkpoint step {steps[-1]}); nothing was changed. Fix: "
                         "choose another --workdir, or resume that run with scone_jax.main.")
    write_probe.check_writable(workdir, _JOIN.startup_timeout.value)
    with ownership.hold(workdir):
        run_lib.save_initial_state(config, workdir, 0)
        if jax.process_index() == 0:
            config_lib.write_config(config, workdir)


def main():
    tool_main.require(hf_dir=_HF_DIR.value, workdir=_WORKDIR.value)
    from scone_jax.runtime import distributed, logs

    logs.quiet_libraries()
    try:
        config = _CONFIG.value
        config.keys()  # a lazy placeholder until used
    except Exception as e:  # noqa: BLE001 - config_flags defers a config file's failure to first use
        raise ValueError(_flag_error(sys.argv) or one_line(e)) from None
    from scone_jax.runtime import workdir as workdir_layout

    try:
        checkpoint = prepare(config, _HF_DIR.value)
        workdir_layout.check_free(_WORKDIR.value, {"--hf_dir": _HF_DIR.value,
                                                   "scone.init_from_hf": config.scone.get("init_from_hf", "")})
    except tool_main.BAD_INPUT as e:  # on a pod (one host's copy of the checkpoint missing): the job stops with it
        distributed.exit_bad_input("import_hf", one_line(e, limit=4000), _JOIN.spec())
    distributed.initialize(_JOIN.spec())
    import_checkpoint(config, _WORKDIR.value)
    import jax

    if jax.process_index() == 0:
        print(f"imported the {checkpoint.family.model_type} checkpoint {_HF_DIR.value} ({config.model.num_layers} "
              f"layers, width {config.model.d_model}, {checkpoint.dtype}) into {_WORKDIR.value} at step 0. Fine-tune "
              f"it: {resume_command(sys.argv, _HF_DIR.value, _WORKDIR.value)}")


def resume_command(argv, hf_dir: str, workdir: str) -> str:
    """The scone_jax.main command that resumes the imported run: this command's --config and --config.* flags (the
    default config file named when it was not), with model.init_from_hf and the workdir."""
    flags_ = [a for a in argv[1:] if a.startswith("--config")]
    if not any(a.startswith("--config=") for a in flags_):
        flags_.insert(0, f"--config={_DEFAULT_CONFIG}")
    flags_ = [a for a in flags_ if not a.startswith("--config.model.init_from_hf=")]
    return " ".join(["python -m scone_jax.main", *flags_, f"--config.model.init_from_hf={hf_dir}", f"--workdir={workdir}"])


if __name__ == "__main__":
    from scone_jax.runtime import distributed as _distributed

    tool_main.run(main, program="import_hf", errors=(*tool_main.BAD_INPUT, _distributed.DistributedStartError),
                  flag_error=_flag_error)
