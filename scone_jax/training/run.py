"""A run, built once: its tokenizer, f-gram vocabulary and batcher, its state (fresh or restored), its train and
eval steps, its training data and held-out sets. The training loop (train.py) takes a Run, and so does every tool
that trains, compiles, replays or exports one, so a new part of a run is wired here and nowhere else.

How the state starts (build's `start`):
  RESUME  training: the newest checkpoint that restores and verifies, after the config and the training files
          were checked against it (refused with CheckpointMismatchError), or a fresh state if there is none;
  FRESH   a fresh state, no checkpoint opened (a replay or a benchmark);
A fresh state is random, or with model.init_from_hf a Hugging Face checkpoint's decoder (state.init_state); for
RESUME and FRESH the config is first derived from that checkpoint (hf/derive.py).
  Latest  the latest checkpoint exactly, the tokenizer and vocabulary loaded as they are, never created (export).
A checkpoint's metadata is read once. `build_abstract` (or `Run.abstract`) gives the same run's shapes without
data or a tokenizer: what an ahead-of-time compile lowers.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from absl import logging

from scone_jax import config as config_lib, saved_config, sharding
from scone_jax.data import identity, mixture, pipeline
from scone_jax.hf import derive as hf_derive
from scone_jax.model import engram, overencoding
from scone_jax.batch import Batch
from scone_jax.runtime import distributed, storage, workdir as workdir_layout
from scone_jax.training import assets, capacity, checkpoint, evaluation, exported_step, state as state_lib, steps

RESUME, FRESH = "resume", "fresh"


@dataclasses.dataclass(frozen=True)
class Latest:
    """A run's latest checkpoint with its metadata, read once: where an export starts. build() takes over the
    checkpointer (Run.close closes it)."""

    checkpointer: checkpoint.Checkpointer
    step: int
    meta: dict

    @classmethod
    def open(cls, workdir: str) -> "Latest":
        ckpt = checkpoint.Checkpointer(workdir_layout.path(workdir, workdir_layout.CHECKPOINTS))
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {workdir}/checkpoints. Fix: train first "
                                    f"(python -m scone_jax.main --workdir={workdir}).")
        return cls(ckpt, step, ckpt.read_checkpoint_meta(step))


@dataclasses.dataclass(frozen=True)
class Abstract:
    """A run's shapes without data: the state and the device batch as ShapeDtypeStructs in their shardings."""

    config: object
    mesh: object
    spec: state_lib.StateSpec
    batch: Batch

    @property
    def state(self):
        return state_lib.abstract_with_shardings(self.spec)

    def lower_train_step(self):
        """The jitted train step (steps.make_train_step) lowered for these shapes."""
        return steps.make_train_step(self.spec.graphdef, self.spec.shardings, self.mesh, self.config).lower(
            self.state, self.batch)


def abstract_batch(config, mesh) -> Batch:
    """The device Batch the training loop sends, as ShapeDtypeStructs sharded by rows: tokens [B, T], and with
    SCONE each batch shard's U unique f-grams of up to K tokens (fgram/dedup.py's layout: one group per data
    shard and micro-batch), with Over-Encoding each position's k(n-1) n-gram ids."""
    rows = (config.data.global_batch_size, config.data.seq_len)
    shapes = dict(inputs=rows, targets=rows, segment_ids=rows, positions=rows, loss_mask=rows)
    if config.scone.enabled:
        accum = config.train.grad_accum_steps
        groups = (sharding.num_batch_shards(mesh) * accum, config.scone.fgram_capacity // accum)
        shapes.update(fgram_tokens=(*groups, config.scone.max_len), fgram_lengths=groups, fgram_slot=rows)
    if config.overencoding.enabled:
        shapes["ngram_ids"] = (*rows, len(overencoding.tables(config.overencoding)))
    if config.engram.enabled:
        shapes["ngram_ids"] = (*rows, sum(len(heads) for heads in engram.heads(config.engram)))
    return Batch(**{
        k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32,
                                sharding=sharding.batch_sharding(mesh))
        for k, shape in shapes.items()
    })


def build_abstract(config, mesh) -> Abstract:
    """The run's shapes with no tokenizer at hand: model.vocab_size 0 is sized for one of data.vocab_size pieces,
    as a run sizes it from the tokenizer it trains."""
    if not config.model.vocab_size:
        with config.unlocked():
            config.model.vocab_size = assets.model_vocab_size(config.data.vocab_size)
    return Abstract(config, mesh, state_lib.state_spec(config, mesh), abstract_batch(config, mesh))


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a run is made of before its first step. `state` is the state it starts from (the train step
    donates it); `restored` the metadata of the checkpoint it came from (None: fresh). The batcher, the training
    data (batches from `step` on) and the held-out sets are made on first use: an export needs none of them."""

    config: object
    workdir: str
    mesh: object
    tokenizer: object
    vocab: object  # FgramVocab, or None without SCONE
    spec: state_lib.StateSpec
    step: int
    state: object
    restored: dict | None
    checkpointer: checkpoint.Checkpointer | None
    data_identity: dict | None  # the training files (data/identity.py), checked on RESUME
    train_step: object
    eval_step: object

    @property
    def expect(self) -> dict:
        """The fingerprints a checkpoint of this run must carry."""
        return _expect(self.tokenizer, self.vocab)

    @functools.cached_property
    def meta(self) -> dict:
        """What every checkpoint of this run saves beside its state (with "step"); computed once per run."""
        return {**self.expect, "config": self.config.to_dict(), "train_data": self.data_identity,
                saved_config.DECLARED_ONLY: not config_lib.undeclared_keys(self.config)}

    def save(self, step: int, state) -> None:
        """Start the checkpoint of `state` at `step` with this run's metadata (`checkpointer.wait()` ends it):
        how the loop saves, and how save_initial_state makes a run's workdir without training."""
        self.checkpointer.save(step, state, {**self.meta, "step": step})

    @functools.cached_property
    def batcher(self):
        """The batch transform that adds each shard's f-grams (fgram/dedup.py), or Over-Encoding's n-gram ids
        (data/ngram_hash.py); None for a plain decoder."""
        if self.vocab is not None:
            return assets.make_batcher(self.config, self.vocab, self.mesh)
        return assets.ngram_hasher(self.config, self.tokenizer)

    @functools.cached_property
    def train_data(self):
        """This process's training batches from batch `step` on (one batch per step: data/packing.py)."""
        check = None
        if self.vocab is not None:  # the f-gram rows a sample of the batches needs, before the first step
            check = functools.partial(capacity.check, self.batcher, first=self.step,
                                      last=self.config.train.num_steps - 1)
        return pipeline.make_train_dataset(self.config.data, self.tokenizer, process_index=jax.process_index(),
                                           process_count=jax.process_count(), batch_transform=self.batcher,
                                           start_batch=self.step, check=check)

    @property
    def sources(self) -> tuple[str, ...]:
        """The training mixture's component names, in order (data/mixture.py); () without a mixture."""
        return tuple(c.name for c in mixture.components(self.config.data) or ())

    @functools.cached_property
    def held_out(self) -> evaluation.HeldOut | None:
        """The held-out sets the loop evaluates on (None with train.eval_every=0)."""
        t = self.config.train
        return evaluation.HeldOut(self.config.data, self.tokenizer, t.eval_batches) if t.eval_every else None

    @property
    def abstract(self) -> Abstract:
        return Abstract(self.config, self.mesh, self.spec, abstract_batch(self.config, self.mesh))

    def model(self):
        """The model of the starting state (SconeModel, or the Decoder without SCONE), optimizer dropped."""
        return state_lib.model_of(self.spec.graphdef, self.state)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


def build(config, workdir: str, mesh, *, start=RESUME, allow_config_changes=()) -> Run:
    """The run of `config` in `workdir` over `mesh`, its state started as `start` says (module docstring).
    Sizes model.vocab_size 0 from the tokenizer (assets.resolve_vocab_size). Refused resumes stop before
    anything in the workdir changes (f-grams, config.json). The data shorthand, if any, is resolved into its
    groups first (config.resolve: idempotent), so every tool's run reads data.mixture and data.eval_sets."""
    config_lib.resolve(config)
    latest = start if isinstance(start, Latest) else None
    if latest is None:
        hf_derive.apply(config)  # model.init_from_hf: the model section and tokenizer from the checkpoint
    if start == FRESH:
        tokenizer = _tokenizer(config, workdir, None)
        vocab, spec = _vocab(config, tokenizer, workdir, None), state_lib.state_spec(config, mesh)
        return _assemble(config, workdir, mesh, tokenizer, vocab, spec, 0, state_lib.init_state(config, spec), None,
                         None, None)
    ckpt = latest.checkpointer if latest else None
    try:
        tokenizer = _tokenizer(config, workdir, latest)
        if ckpt is None:
            ckpt = checkpoint.Checkpointer(workdir_layout.path(workdir, workdir_layout.CHECKPOINTS),
                                           keep=config.train.keep_checkpoints)
        identity_ = None if latest else identity.train_data_identity(config.data)
        newest = (latest.step, latest.meta) if latest else _newest_meta(ckpt)
        if not latest:
            check_resume(ckpt, newest, config, allow_config_changes, identity_)
        vocab = _vocab(config, tokenizer, workdir, latest)
        spec = state_lib.state_spec(config, mesh)
        expect = _expect(tokenizer, vocab)
        if latest:
            state, saved = state_lib.restore(ckpt, latest.step, config, spec, mesh, expect=expect, meta=latest.meta)
            step = latest.step
        else:
            step, state, saved = _restore_newest_good(ckpt, config, spec, mesh, expect, newest)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    return _assemble(config, workdir, mesh, tokenizer, vocab, spec, step, state, saved, ckpt, identity_)


def save_initial_state(config, workdir: str, step: int) -> tuple:
    """Build `config`'s run in `workdir`, save its initial state as the checkpoint of `step` exactly as the loop
    saves one, and close it; (tokenizer, vocab). For tools and tests that need a run's workdir (an export's
    input, a resume) and not the steps that would lead there: what build restores does not depend on them."""
    run = build(config, workdir, sharding.make_mesh(config.mesh))
    try:
        run.save(step, run.state)
        run.checkpointer.wait()
    finally:
        run.close()
    return run.tokenizer, run.vocab


def _expect(tokenizer, vocab) -> dict:
    return {"tokenizer_fingerprint": tokenizer.fingerprint,
            "fgram_vocab_fingerprint": vocab.fingerprint if vocab is not None else None}


def _assemble(config, workdir, mesh, tokenizer, vocab, spec, step, state, saved, ckpt, identity_) -> Run:
    return Run(config, workdir, mesh, tokenizer, vocab, spec, step, state, saved, ckpt, identity_,
               train_step=_make_train_step(spec, mesh, config),
               eval_step=steps.make_eval_step(spec.model_graphdef, spec.model_shardings, mesh))


def _tokenizer(config, workdir: str, latest):
    """The run's tokenizer (trained into the workdir on first use, except for an export), model.vocab_size 0 sized
    from it."""
    if latest is not None:  # as the run left it: an export never trains a tokenizer or extracts f-grams
        tokenizer = assets.existing_tokenizer(config.data, workdir)
    else:
        tokenizer = distributed.chief_first("tokenizer", lambda: assets.ensure_tokenizer(config.data, workdir))
    assets.resolve_vocab_size(config, tokenizer)
    overencoding.check(config)  # m coprime with model.vocab_size, now that it is known
    return tokenizer


def _vocab(config, tokenizer, workdir: str, latest):
    """The f-gram vocabulary (None without SCONE): extracted into the workdir on first use, except for an export."""
    if not config.scone.enabled:
        return None
    if latest is not None:
        return assets.existing_vocab(config.scone, tokenizer, workdir)
    return assets.fgram_vocab(config, tokenizer, workdir)


def _make_train_step(spec, mesh, config):
    """With the compilation cache on, the step exported beside it (exported_step.py: a restart neither traces
    nor compiles it); without, the plain jitted step."""
    directory = jax.config.jax_compilation_cache_dir if config.train.compilation_cache_dir else ""
    if not directory or storage.is_remote(directory):
        return steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    return exported_step.ExportedTrainStep(spec.graphdef, spec.shardings, mesh, config, directory)


def _newest_meta(ckpt) -> tuple[int | None, dict | None]:
    """(latest step, its metadata): (None, None) without checkpoints; metadata None if it cannot be read (the
    restore then reports the checkpoint as damaged)."""
    step = ckpt.latest_step()
    if step is None:  # (step 0 is a checkpoint too: tools/import_hf.py saves one)
        return step, None
    try:
        return step, ckpt.read_checkpoint_meta(step)
    except Exception:  # noqa: BLE001 - an unreadable checkpoint is reported (and skipped) by the restore
        return step, None


def check_resume(ckpt, newest: tuple, config, allowed, train_data: dict) -> None:
    """Refuse to resume the latest checkpoint (`newest`: its step and metadata) with changed RESUME_KEYS or changed
    training files (appended, edited, added or removed: the same batch numbers would mean other documents),
    listing every difference."""
    step, meta = newest
    if step is None or meta is None:  # step 0 (an imported run) is checked like any other
        return
    changes = [c for c in config_lib.resume_changes(meta.get("config", {}), config)]
    if "train_data" not in meta:
        changes.append("data.train_files: the checkpoint does not record its training files")
    else:
        changes += [f"data.train_files: {c}" for c in identity.identity_changes(meta["train_data"], train_data)[:5]]
    changes = [c for c in changes if c.split(":")[0] not in allowed]
    if changes:
        raise checkpoint.CheckpointMismatchError(
            f"Resuming {ckpt.directory}/{step} with a config that changes what the checkpoint's state or data stream "
            f"mean: {'; '.join(changes)}. Nothing was changed in the workdir. Fix: restore those values, use a fresh "
            f"--workdir, or, if the change is intended, rerun with "
            f"--allow_config_change={','.join(dict.fromkeys(c.split(':')[0] for c in changes))}.")


def _restore_newest_good(ckpt, config, spec, mesh, expect, newest):
    """(step, state, its metadata) of the newest checkpoint that restores and verifies, or (0, a fresh state, None).

    A damaged newer checkpoint is set aside (renamed damaged-<step>, kept for inspection) with a
    warning, once an older good one is found; if none is good, nothing is renamed and the error
    says how to start over."""
    damaged = []
    for step in sorted(ckpt.all_steps(), reverse=True):
        try:
            meta = newest[1] if step == newest[0] and newest[1] is not None else None
            state, saved = state_lib.restore(ckpt, step, config, spec, mesh, expect=expect, meta=meta)
        except checkpoint.CheckpointDamagedError as e:
            logging.warning("%s", e)
            damaged.append(step)
            continue
        for bad in damaged:
            logging.warning("Checkpoint step %d is damaged: moved to %s; resuming from step %d instead.",
                            bad, ckpt.set_aside(bad), step)
        logging.info("Resumed from step %d", step)
        if saved.get("process_count", jax.process_count()) != jax.process_count():
            logging.warning("Checkpoint step %d was written by %d processes and this run has %d: the documents "
                            "are shared out anew, so each process now reads another part of the data.",
                            step, saved["process_count"], jax.process_count())
        return step, state, saved
    if damaged:
        older = f"so are the older ones ({', '.join(map(str, damaged[1:]))})" if damaged[1:] else "no older one is kept"
        raise checkpoint.CheckpointDamagedError(
            ckpt.directory, damaged[0],
            f"{older}, so there is nothing to resume from; nothing was changed. Fix: restore the checkpoint files "
            f"from a copy, or move {ckpt.directory} aside to train from scratch")
    return 0, state_lib.init_state(config, spec), None
