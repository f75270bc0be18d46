"""The training loop: steps, metrics, periodic evaluation, checkpoints and exact resume.

Resume is automatic: if <workdir>/checkpoints holds a checkpoint, the state and the data
iterator position are restored and training continues from that step. On SIGTERM the loop
finishes the current step, saves a checkpoint there and raises preemption.Preempted.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
import zlib

import jax
import numpy as np
from absl import logging

from scone_jax import config as config_lib, sharding
from scone_jax.batch import Batch
from scone_jax.data import eval_sets, identity, mixture, pipeline
from scone_jax.fgram import stats as fgram_stats
from scone_jax.model import accounting, scone
from scone_jax.runtime import compile_cache, distributed, storage, workdir as workdir_layout
from scone_jax.runtime.compile_cache import CompileCache
from scone_jax.runtime.errors import one_line
from scone_jax.runtime.ownership import OwnershipLost, hold as hold_workdir
from scone_jax.training import assets, checkpoint, exported_step, preemption, profile, state as state_lib, steps
from scone_jax.training.metrics import MetricsWriter, format_line
from scone_jax.training.throughput import Throughput, peak_flops_per_device, process_uptime_s


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept as the latest."""


class InputPipelineError(ValueError):
    """Building a batch failed (bad data, a worker process that died); the run saved a
    checkpoint at the step it had reached, so a rerun after the fix loses nothing."""


def batch_fingerprint(batch: Batch) -> int:
    """CRC32 of every array a host batch sends to the device (inputs, masks and, with SCONE,
    the f-gram rows and slots), in field-name order: cheap, and what resume must replay exactly."""
    crc = 0
    for key, array in sorted(batch.for_device().arrays().items()):
        crc = zlib.crc32(key.encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(array).tobytes(), crc)
    return crc


def held_out_loss(eval_step, model_state, batches, mesh, batch_transform=None, max_batches: int = 0) -> dict:
    """Held-out loss and perplexity of the training graph over `batches` (pipeline.EvalBatches; at most
    `max_batches` of them, 0 = all), each through `batch_transform` (the f-gram batcher) first.
    serving.evaluate is the exported model's evaluation: the same eval step, table rows in the batch."""
    loss_sum, count = 0.0, 0.0
    for i, batch in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        if batch_transform is not None:
            batch = batch_transform(batch)
        l, n = eval_step(model_state, sharding.global_batch(batch.for_device(), mesh))
        loss_sum, count = loss_sum + float(l), count + float(n)
    loss = loss_sum / max(count, 1.0)
    return {"loss": loss, "perplexity": scone.perplexity(loss), "tokens": count}


class _HeldOut:
    """The held-out sets of data.eval_files (data/eval_sets.py), read and checked when the run starts, and
    their evaluation: {set name: loss, perplexity, bits_per_byte, tokens}, plus the unweighted average of
    named sets as `average` (an unnamed value's one set is named '')."""

    def __init__(self, data_cfg, tokenizer, max_batches: int):
        self.max_batches = max_batches
        configs = eval_sets.configs(data_cfg)
        self.sets = {name: pipeline.make_eval_batches(cfg, tokenizer, process_index=jax.process_index(),
                                                      process_count=jax.process_count())
                     for name, cfg in configs.items()}
        # Bits per byte needs every document once: not with train.eval_batches limiting the batches.
        self.bytes = {name: 0 if max_batches and max_batches < len(self.sets[name]) else
                      eval_sets.held_out_bytes(cfg, tokenizer) for name, cfg in configs.items()}

    def evaluate(self, eval_step, model_state, mesh, batcher) -> dict:
        results = {}
        for name, batches in self.sets.items():
            ev = held_out_loss(eval_step, model_state, batches, mesh, batcher, self.max_batches)
            bpb = eval_sets.bits_per_byte(ev["loss"], ev["tokens"], self.bytes[name])
            results[name] = {**ev, **({"bits_per_byte": bpb} if bpb is not None else {})}
        if eval_sets.SINGLE not in results:
            mean = {k: v for k, v in eval_sets.average(results).items() if v is not None}
            results[eval_sets.AVERAGE] = {**mean, "tokens": sum(r["tokens"] for r in results.values())}
        return results


class EvaluationError(ValueError):
    """The periodic held-out evaluation failed mid-run; a checkpoint at that step was saved first."""


class _PendingMetrics:
    """Device metrics of recent steps, fetched together so the host never waits per step.

    `restored` names the checkpoint this run resumed from: a non-finite loss up to step
    `suspect_until` then points at that checkpoint rather than at the learning rate."""

    def __init__(self, restored: str | None = None, suspect_until: int = 0):
        self.items, self._restored, self._suspect_until = [], restored, suspect_until

    def add(self, step, metrics, host_figures: dict):
        self.items.append((step, metrics, host_figures))

    def flush(self) -> list[dict]:
        fetched = jax.device_get([m for _, m, _ in self.items])
        records = [
            {"step": s, **host, **{k: float(v) for k, v in m.items()}}
            for (s, _, host), m in zip(self.items, fetched)
        ]
        self.items = []
        for r in records:
            bad = {k: r[k] for k in ("loss", "grad_norm", "param_norm") if not math.isfinite(r[k])}
            if bad and self._restored and r["step"] <= self._suspect_until:
                raise NonFiniteLossError(
                    f"Non-finite {bad} at step {r['step']}, right after resuming from {self._restored}: that "
                    "checkpoint's state is probably bad. Training stopped and nothing was saved. Fix: move it aside "
                    f"(mv {self._restored} {self._restored}.bad) and rerun to resume from the checkpoint before it."
                )
            if bad:
                raise NonFiniteLossError(
                    f"Non-finite {bad} at step {r['step']}; training stopped and the bad state "
                    "was not saved. Lower train.learning_rate, enable train.grad_clip_norm, or check "
                    "the data; the next run resumes from the last good checkpoint."
                )
        return records


def run(config, workdir: str, allow_config_changes=()) -> dict:
    """Train per `config` in `workdir`, resuming if a checkpoint exists. Returns final metrics.

    Resuming with a different value of a key in config.RESUME_KEYS (what defines the saved state
    and the data stream) is refused unless the key is named in `allow_config_changes`."""
    config_lib.validate(config)
    unknown = sorted(set(allow_config_changes) - set(config_lib.RESUME_KEYS))
    if unknown:
        raise ValueError(f"--allow_config_change names {unknown}, which are not checked on resume; the keys it "
                         f"accepts: {', '.join(config_lib.RESUME_KEYS)}.")
    mesh = sharding.make_mesh(config.mesh)
    config_lib.validate_batch_split(config, sharding.num_batch_shards(mesh))
    profile.check_tracer(config.train.profile_steps)
    # The workdir is taken before anything is written there and released however the run ends; SIGTERM stops
    # start-up cleanly (the loop's preemption.Watch takes it over at the first step).
    # The SIGTERM handler comes first, so a SIGTERM while the lease is being taken is a clean stop too.
    with preemption.stop_on_sigterm_until_training(), hold_workdir(workdir) as owner, \
            CompileCache(compile_cache.resolve(config.train.compilation_cache_dir, workdir)):
        return _train(config, workdir, mesh, owner, allow_config_changes)


def _make_train_step(spec, mesh, config):
    """With the compilation cache on, the step exported beside it (exported_step.py: a restart neither traces
    nor compiles it); without, the plain jitted step."""
    directory = jax.config.jax_compilation_cache_dir if config.train.compilation_cache_dir else ""
    if not directory or storage.is_remote(directory):
        return steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    return exported_step.ExportedTrainStep(spec.graphdef, spec.shardings, mesh, config, directory)


def _train(config, workdir: str, mesh, owner, allow_config_changes) -> dict:
    """run() once this job owns the workdir; every process stops before its next write if another run
    takes the workdir over (`owner.lost()`, checked together at the steps that write)."""
    is_chief = jax.process_index() == 0
    tokenizer = distributed.chief_first("tokenizer", lambda: assets.ensure_tokenizer(config.data, workdir))
    assets.resolve_vocab_size(config, tokenizer)
    logging.info("Mesh %s over %d devices (%d processes)", dict(mesh.shape), jax.device_count(), jax.process_count())
    ckpt = checkpoint.Checkpointer(workdir_layout.path(workdir, workdir_layout.CHECKPOINTS),
                                   keep=config.train.keep_checkpoints)
    try:
        # Refused resumes stop here, before anything in the workdir changes (f-grams, config.json).
        train_data = identity.train_data_identity(config.data)
        _check_resume_config(ckpt, config, allow_config_changes, train_data)
        vocab, batcher = assets.fgram_batcher(config, tokenizer, workdir, mesh)
        spec = state_lib.state_spec(config, mesh)
        expect = {
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "fgram_vocab_fingerprint": vocab.fingerprint if vocab else None,
        }
        step, state = _restore_newest_good(ckpt, config, spec, mesh, expect)
    except BaseException:
        ckpt.close()
        raise
    if is_chief:
        config_lib.write_config(config, workdir)
        workdir_layout.remove_stale_done(workdir, config.train.num_steps)  # before the first step
    logging.info("Parameters: %s", {k: f"{v:,}" for k, v in accounting.param_counts(spec.abstract[0]).items()})
    flops = accounting.train_step_flops(config, spec.abstract[0], sharding.num_batch_shards(mesh))
    meta = {**expect, "config": config.to_dict(), "train_data": train_data}
    # The held-out data is read (tokenized) and checked now, before step 1: a missing or empty eval file must
    # stop the run before it has done work that the error would lose.
    held_out = _HeldOut(config.data, tokenizer, config.train.eval_batches) if config.train.eval_every else None
    # One batch per step: the batch numbers continue where the checkpoint stopped (packing.py).
    inputs = _Inputs(pipeline.make_train_dataset(
        config.data, tokenizer, process_index=jax.process_index(), process_count=jax.process_count(),
        batch_transform=batcher, start_batch=step,
    ), mesh, batcher, pipeline.worker_count(config.data),
        tuple(c.name for c in mixture.parse(config.data.train_files) or ()))

    train_step = _make_train_step(spec, mesh, config)
    eval_step = steps.make_eval_step(spec.model_graphdef, spec.model_shardings, mesh)
    writer = MetricsWriter(workdir, enabled=is_chief, resume_step=step)
    t = config.train
    peak = peak_flops_per_device(t.peak_flops_per_device) * jax.device_count()
    meter = Throughput(t.num_steps, step, flops["total"], peak)
    pending = _PendingMetrics(f"{ckpt.directory}/{step}" if step else None, step + t.log_every)
    window, summary = [], {}
    stop_at = min(t.num_steps, step + t.max_steps_per_run) if t.max_steps_per_run else t.num_steps
    watch = preemption.Watch()
    profiler = profile.StepProfiler(t.profile_steps, workdir, enabled=is_chief or t.profile_all_processes)
    missed = profile.unreached(t.profile_steps, step + 1, stop_at)
    if missed and is_chief:
        logging.warning("%s", missed)
    startup = None
    try:
        batch = _next_batch(inputs, step, None) if step < stop_at else None
        while step < stop_at:
            host, device_arrays = batch
            profiler.before(step + 1)
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                state, metrics = train_step(state, device_arrays)  # dispatched; the device works on it
            step += 1
            if startup is None:  # how long a (re)start takes to train its first step: compilation, restore, data
                jax.block_until_ready(metrics)
                startup = process_uptime_s()
                logging.info("Step %d done %.1f s after the process started", step, startup)
                writer.write(step, {"first_step_s": startup}, prefix="startup")
            pending.add(step, metrics, host)
            if step < stop_at:  # the next batch is built and sent meanwhile
                with jax.profiler.TraceAnnotation("input_wait"):
                    batch = _next_batch(inputs, step,
                                        lambda: _save_after_input_failure(ckpt, step, state, meta, pending, writer))
            profiler.after(step, metrics)
            plan = _StepPlan.at(step, t, last=step == stop_at, preempted=watch.reached(step))
            if plan.writes and distributed.any_process(owner.lost()):  # another run took the workdir over
                owner.check()  # process 0 names the new owner
                raise OwnershipLost(f"--workdir={workdir} was taken over by another run (process 0 logs which); "
                                    "this run stopped before writing there again.")
            ckpt.raise_if_failed()  # a failed save stops the run now, not at the next save
            if plan.flush:
                records = pending.flush()
                writer.write_steps(records)
                window += records
            if window and plan.log:
                summary = _summarize(window, meter.update(step, sum(r["tokens"] for r in window)))
                summary["input_wait_fraction"] = inputs.wait_fraction()
                window = []
                writer.write(step, summary)
                logging.info(format_line(step, t.num_steps, summary))
            if plan.evaluate:
                try:
                    results = held_out.evaluate(eval_step, state[0], mesh, batcher)
                except Exception as e:  # the held-out data was checked at start; whatever fails now, keep the work
                    _save_after_input_failure(ckpt, step, state, meta, pending, writer)
                    raise EvaluationError(
                        f"The held-out evaluation at step {step} failed: {type(e).__name__}: {one_line(e)}. A "
                        f"checkpoint was saved at step {step}: rerun the same command after the fix to resume there "
                        "(or set train.eval_every=0 to train without evaluating).") from e
                for name, ev in results.items():
                    writer.write(step, ev, prefix=f"eval/{name}" if name else "eval")
                    logging.info("eval%s step %d: loss %.4f ppl %.2f bits/byte %s over %d tokens",
                                 f" {name}" if name else "", step, ev["loss"], ev["perplexity"],
                                 f"{ev['bits_per_byte']:.4f}" if ev.get("bits_per_byte") is not None else "-",
                                 ev.get("tokens", 0))
                    summary.update({f"eval_{name}_{k}" if name else f"eval_{k}": v for k, v in ev.items()})
            if plan.save:
                ckpt.save(step, state, {**meta, "step": step})
            if plan.preempted and not plan.last:
                raise preemption.Preempted(step)
    finally:
        profiler.close()
        inputs.close()
        watch.close()
        try:
            ckpt.wait()  # CheckpointWriteError if the last save failed
        finally:
            ckpt.close()
            writer.close(publish=not owner.lost())  # never overwrite the metrics of a run that took over
    if step == t.num_steps and is_chief:  # finished (its last checkpoint is written): what launchers wait for
        storage.write_bytes(workdir, workdir_layout.DONE,
                            json.dumps({"step": step, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                            .encode())
    return {"step": step, **summary}


@dataclasses.dataclass(frozen=True)
class _StepPlan:
    """What the loop does after a step, decided once: log (a log line), evaluate, save (a checkpoint),
    flush (fetch the pending device metrics: for a log line or before a save), writes (anything reaches
    the workdir, so ownership is checked first)."""

    last: bool
    preempted: bool
    log: bool
    evaluate: bool
    save: bool

    @classmethod
    def at(cls, step: int, t, *, last: bool, preempted: bool) -> "_StepPlan":
        return cls(last=last, preempted=preempted, log=step % t.log_every == 0 or last,
                   evaluate=bool(t.eval_every) and (step % t.eval_every == 0 or last),
                   save=step % t.checkpoint_every == 0 or last or preempted)

    @property
    def flush(self) -> bool:
        return self.log or self.save

    @property
    def writes(self) -> bool:
        return self.log or self.evaluate or self.save


def _check_resume_config(ckpt, config, allowed, train_data: dict) -> None:
    """Refuse to resume the latest checkpoint with changed RESUME_KEYS or changed training files (appended,
    edited, added or removed: the same batch numbers would mean other documents), listing every difference."""
    step = ckpt.latest_step()
    if not step:
        return
    try:
        meta = ckpt.read_checkpoint_meta(step)
    except Exception:  # noqa: BLE001 - an unreadable checkpoint is reported (and skipped) by the restore
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


def _restore_newest_good(ckpt, config, spec, mesh, expect):
    """(step, state) of the newest checkpoint that restores and verifies, or (0, a fresh state).

    A damaged newer checkpoint is set aside (renamed damaged-<step>, kept for inspection) with a
    warning, once an older good one is found; if none is good, nothing is renamed and the error
    says how to start over."""
    steps_ = sorted(ckpt.all_steps(), reverse=True)
    damaged = []
    for step in steps_:
        try:
            state, saved = state_lib.restore(ckpt, step, config, spec, mesh, expect=expect)
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
        return step, state
    if damaged:
        older = f"so are the older ones ({', '.join(map(str, damaged[1:]))})" if damaged[1:] else "no older one is kept"
        raise checkpoint.CheckpointDamagedError(
            ckpt.directory, damaged[0],
            f"{older}, so there is nothing to resume from; nothing was changed. Fix: restore the checkpoint files "
            f"from a copy, or move {ckpt.directory} aside to train from scratch")
    return 0, state_lib.init_state(config, spec)


def _next_batch(inputs, step: int, save):
    """inputs.next(), with a failure turned into InputPipelineError after `save()` (if given)."""
    try:
        return inputs.next()
    except Exception as e:  # a worker's exception comes back as itself; a dead worker as RuntimeError
        saved = ""
        if save is not None:
            save()
            saved = (f" A checkpoint was saved at step {step}: rerun the same command after the fix to resume there "
                     "(with --allow_config_change=data.train_files if the fix edits the training files).")
        first = one_line(e)
        raise InputPipelineError(
            f"The input pipeline failed while preparing step {step + 1}: {type(e).__name__}: {first}.{saved} "
            "If a worker process died without a message, it may have run out of memory: lower "
            "data.worker_count.") from e


def _save_after_input_failure(ckpt, step, state, meta, pending, writer):
    writer.write_steps(pending.flush())
    ckpt.save(step, state, {**meta, "step": step})
    ckpt.wait()


class _Inputs:
    """Host batches -> (host figures, device arrays), timing how long the loop waits for them.

    wait_fraction() is the share of wall time since its last call that the loop spent here
    (building or waiting for the batch, and starting its transfer); above WAIT_WARNING it
    logs what to change, the first time and then every WARN_EVERY calls."""

    WAIT_WARNING, WARN_EVERY = 0.10, 50

    def __init__(self, dataset, mesh, batcher, workers: int, sources_: tuple[str, ...] = ()):
        self._iter, self._mesh, self._batcher, self._workers = iter(dataset), mesh, batcher, workers
        self._sources = sources_  # the training mixture's component names (data/mixture.py), in order
        self._waited, self._since = 0.0, time.perf_counter()
        self._calls, self._warned_at = 0, None

    def next(self):
        start = time.perf_counter()
        host_batch = next(self._iter)
        host = {"batch_crc": batch_fingerprint(host_batch)}
        if self._sources:  # tokens per mixture component (every process deals its rows by the same schedule)
            per_row = host_batch.loss_mask.sum(axis=1)
            for c, name in enumerate(self._sources):
                host[f"mix/tokens_{name}"] = float(per_row[host_batch.row_source == c].sum()) * jax.process_count()
        if self._batcher is not None:
            host.update(fgram_stats.batch_stats(host_batch))
            host["fgram/model_tokens"] = host_batch.fgram_tokens.size * jax.process_count()
        arrays = sharding.global_batch(host_batch.for_device(), self._mesh)
        self._waited += time.perf_counter() - start
        return host, arrays

    def wait_fraction(self) -> float:
        now = time.perf_counter()
        fraction = self._waited / max(now - self._since, 1e-9)
        self._waited, self._since = 0.0, now
        self._calls += 1
        # The first interval holds worker start-up and compilation: not a steady-state figure.
        if fraction > self.WAIT_WARNING and self._calls > 1 and (
                self._warned_at is None or self._calls - self._warned_at >= self.WARN_EVERY):
            self._warned_at = self._calls
            logging.warning(
                "The training loop waited for input %.0f%% of the time: the host does not build batches as "
                "fast as the devices use them. Fix: raise data.worker_count (%d worker processes now; -1 = half "
                "the cores), or pre-tokenize text corpora (tools/pretokenize.py, then data.source=arrayrecord).",
                100 * fraction, self._workers)
        return fraction

    def close(self):
        close = getattr(self._iter, "close", None)
        if close is not None:
            close()


def _summarize(records: list[dict], rates: dict) -> dict:
    """Window means of loss and f-gram figures, last values of the rest, plus rates."""
    loss = float(np.mean([r["loss"] for r in records]))
    fgram = {k: float(np.mean([r[k] for r in records])) for k in records[-1] if k.startswith("fgram/")}
    mix = {k: float(np.sum([r[k] for r in records])) for k in records[-1] if k.startswith("mix/")}
    return {
        **mix,
        "loss": loss,
        "perplexity": scone.perplexity(loss),
        "grad_norm": records[-1]["grad_norm"],
        "learning_rate": records[-1]["learning_rate"],
        **fgram,
        **rates,
    }
