"""The training loop: steps, metrics, periodic evaluation, checkpoints and exact resume.

Resume is automatic: if <workdir>/checkpoints holds a checkpoint, the state and the data
iterator position are restored and training continues from that step. On SIGTERM or Ctrl-C the
loop finishes the current step, saves a checkpoint there and raises preemption.Preempted; a second
Ctrl-C raises KeyboardInterrupt at once, naming the checkpoint kept (`kept_step`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import zlib

import jax
import numpy as np
from absl import logging

from scone_jax import config as config_lib, sharding
from scone_jax.batch import Batch
from scone_jax.data import pipeline
from scone_jax.fgram import stats as fgram_stats
from scone_jax.hf import derive as hf_derive
from scone_jax.model import accounting, scone
from scone_jax.runtime import compile_cache, distributed, storage, workdir as workdir_layout
from scone_jax.runtime.compile_cache import CompileCache
from scone_jax.runtime.errors import one_line
from scone_jax.runtime.ownership import OwnershipLost, hold as hold_workdir
from scone_jax.training import preemption, profile, run as run_lib
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
    and the data stream) is refused unless the key is named in `allow_config_changes`. With model.init_from_hf the
    config is derived from that checkpoint first (hf/derive.py), before anything is written."""
    hf_derive.apply(config)
    config_lib.validate(config)
    unknown = sorted(set(allow_config_changes) - set(config_lib.RESUME_KEYS))
    if unknown:
        raise ValueError(f"--allow_config_change names {unknown}, which are not checked on resume; the keys it "
                         f"accepts: {', '.join(config_lib.RESUME_KEYS)}.")
    mesh = sharding.make_mesh(config.mesh)
    config_lib.validate_batch_split(config, sharding.num_batch_shards(mesh))
    profile.check_tracer(config.train.profile_steps)
    workdir_layout.check_free(workdir, input_directories(config))  # nothing of the user's is overwritten
    # The workdir is taken before anything is written there and released however the run ends; SIGTERM stops
    # start-up cleanly (the loop's preemption.Watch takes it over at the first step).
    # The SIGTERM handler comes first, so a SIGTERM while the lease is being taken is a clean stop too.
    with preemption.stop_on_sigterm_until_training(), hold_workdir(workdir) as owner, \
            CompileCache(compile_cache.resolve(config.train.compilation_cache_dir, workdir)):
        logging.info("Mesh %s over %d devices (%d processes)", dict(mesh.shape), jax.device_count(),
                     jax.process_count())
        return _train(run_lib.build(config, workdir, mesh, allow_config_changes=allow_config_changes), owner)


def input_directories(config) -> dict[str, str]:
    """The directories a run reads that its workdir must not be (runtime/outputs.py): its Hugging Face sources."""
    return {f"{section}.init_from_hf": config[section].get("init_from_hf", "") for section in ("model", "scone")}


def _train(run: run_lib.Run, owner) -> dict:
    """run() once this job owns the workdir and its run is built; every process stops before its next write if
    another run takes the workdir over (`owner.lost()`, checked together at the steps that write)."""
    config, workdir, is_chief = run.config, run.workdir, jax.process_index() == 0
    try:
        if is_chief:
            config_lib.write_config(config, workdir)
            workdir_layout.remove_stale_done(workdir, config.train.num_steps)  # before the first step
        if run.step >= config.train.num_steps:  # started again after it finished: say so, start no data workers
            logging.info("This run has finished: its checkpoint of step %d is the last of train.num_steps=%d, so "
                         "there is nothing to train. Raise --config.train.num_steps to train on, or serve it: "
                         "python -m scone_jax.serving.export --workdir=%s --output=DIR", run.step,
                         config.train.num_steps, workdir)
            run.close()
            if is_chief:
                _mark_done(workdir, run.step)
            return {"step": run.step}
        logging.info("Parameters: %s", {k: f"{v:,}" for k, v in accounting.param_counts(run.spec.abstract[0]).items()})
        # The held-out data is read (tokenized) and checked now, before step 1: a missing or empty eval file must
        # stop the run before it has done work that the error would lose.
        held_out = run.held_out
        # One batch per step: the batch numbers continue where the checkpoint stopped (packing.py).
        inputs = _Inputs(run.train_data, run.mesh, pipeline.worker_count(config.data), run.sources)
        loop = _Loop(run, owner, held_out, inputs)
    except BaseException:
        run.close()
        raise
    step, summary = loop.train()
    if step == config.train.num_steps and is_chief:  # finished, its last checkpoint written: what launchers wait for
        _mark_done(workdir, step)
    return {"step": step, **summary}


def _mark_done(workdir: str, step: int) -> None:
    """WORKDIR/DONE: the run trained all its steps and wrote its last checkpoint (launch/tpu.py babysit waits for
    it)."""
    storage.write_bytes(workdir, workdir_layout.DONE,
                        json.dumps({"step": step, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                        .encode())


class _Loop:
    """The steps of one run() from the run's step to stop_at (train.num_steps, or train.max_steps_per_run
    steps on): each step dispatched while the next batch is built, then what _StepPlan says after it."""

    def __init__(self, run: run_lib.Run, owner, held_out, inputs):
        t = self.t = run.config.train
        self.run, self.owner, self.held_out, self.inputs = run, owner, held_out, inputs
        self.ckpt, self.step, self.state = run.checkpointer, run.step, run.state
        is_chief = jax.process_index() == 0
        flops = accounting.train_step_flops(run.config, run.spec.abstract[0], sharding.num_batch_shards(run.mesh))
        self.writer = MetricsWriter(run.workdir, enabled=is_chief, resume_step=self.step)
        peak = peak_flops_per_device(t.peak_flops_per_device) * jax.device_count()
        self.meter = Throughput(t.num_steps, self.step, flops["total"], peak)
        self.pending = _PendingMetrics(f"{self.ckpt.directory}/{self.step}" if self.step else None,
                                       self.step + t.log_every)
        self.window, self.summary = [], {}
        self.stop_at = min(t.num_steps, self.step + t.max_steps_per_run) if t.max_steps_per_run else t.num_steps
        self.watch = preemption.Watch()
        self.heartbeat = _Heartbeat(t.num_steps)
        self.profiler = profile.StepProfiler(t.profile_steps, run.workdir, enabled=is_chief or t.profile_all_processes)
        missed = profile.unreached(t.profile_steps, self.step + 1, self.stop_at)
        if missed and is_chief:
            logging.warning("%s", missed)

    def train(self) -> tuple[int, dict]:
        """(the step reached, the last log line's figures)."""
        startup = None
        try:
            if self.step < self.stop_at:
                logging.info("Building the first batch and compiling the train step (on a CPU, about a minute)")
            batch = _next_batch(self.inputs, self.step, None) if self.step < self.stop_at else None
            while self.step < self.stop_at:
                host, device_arrays = batch
                self.profiler.before(self.step + 1)
                with jax.profiler.StepTraceAnnotation("train", step_num=self.step + 1):
                    self.state, metrics = self.run.train_step(self.state, device_arrays)  # dispatched
                self.step += 1
                step = self.step
                if startup is None:  # how long a (re)start takes to train its first step: compilation, restore, data
                    jax.block_until_ready(metrics)
                    startup = process_uptime_s()
                    logging.info("Step %d done %.1f s after the process started", step, startup)
                    self.heartbeat.started(step)
                    self.writer.write(step, {"first_step_s": startup}, prefix="startup")
                self.pending.add(step, metrics, host)
                if step < self.stop_at:  # the next batch is built and sent meanwhile
                    with jax.profiler.TraceAnnotation("input_wait"):
                        batch = _next_batch(self.inputs, step, self._save_now)
                self.profiler.after(step, metrics)
                self._after_step(step)
        except KeyboardInterrupt as e:  # a second Ctrl-C: say which checkpoint is kept (a save in flight ends first)
            self.ckpt.wait()
            e.kept_step = self.ckpt.latest_step()
            raise
        finally:
            self._close()
        return self.step, self.summary

    def _after_step(self, step: int) -> None:
        t = self.t
        plan = _StepPlan.at(step, t, last=step == self.stop_at, preempted=self.watch.reached(step))
        if plan.writes and distributed.any_process(self.owner.lost()):  # another run took the workdir over
            self.owner.check()  # process 0 names the new owner
            raise OwnershipLost(f"--workdir={self.run.workdir} was taken over by another run (process 0 logs which); "
                                "this run stopped before writing there again.")
        self.ckpt.raise_if_failed()  # a failed save stops the run now, not at the next save
        if plan.flush:
            records = self.pending.flush()
            self.writer.write_steps(records)
            self.window += records
        if self.window and plan.log:
            self.summary = _summarize(self.window, self.meter.update(step, sum(r["tokens"] for r in self.window)))
            self.summary["input_wait_fraction"] = self.inputs.wait_fraction()
            self.window = []
            self.writer.write(step, self.summary)
            logging.info(format_line(step, t.num_steps, self.summary))
            self.heartbeat.logged()
        elif not plan.last:
            self.heartbeat.beat(step)
        if plan.evaluate:
            self._evaluate(step)
        if plan.save:
            self.run.save(step, self.state)
        if plan.preempted and not plan.last:
            raise preemption.Preempted(step, self.watch.stopped_by)

    def _evaluate(self, step: int) -> None:
        try:
            results = self.held_out.evaluate(functools.partial(self.run.eval_step, self.state[0]), self.run.mesh,
                                             rows=self.run.batcher)
        except Exception as e:  # the held-out data was checked at start; whatever fails now, keep the work
            self._save_now()
            raise EvaluationError(
                f"The held-out evaluation at step {step} failed: {type(e).__name__}: {one_line(e)}. A "
                f"checkpoint was saved at step {step}: rerun the same command after the fix to resume there "
                "(or set train.eval_every=0 to train without evaluating).") from e
        for name, ev in results.items():
            ev = {k: v for k, v in ev.items() if v is not None}
            self.writer.write(step, ev, prefix=f"eval/{name}" if name else "eval")
            logging.info("eval%s step %d: loss %.4f ppl %.2f bits/byte %s over %d tokens",
                         f" {name}" if name else "", step, ev["loss"], ev["perplexity"],
                         f"{ev['bits_per_byte']:.4f}" if ev.get("bits_per_byte") is not None else "-",
                         ev.get("tokens", 0))
            self.summary.update({f"eval_{name}_{k}" if name else f"eval_{k}": v for k, v in ev.items()})

    def _save_now(self) -> None:
        """A checkpoint at the step reached, its pending metrics written first: before an input or evaluation
        failure stops the run, so a rerun after the fix loses nothing."""
        _save_after_input_failure(self.run, self.step, self.state, self.pending, self.writer)

    def _close(self) -> None:
        self.profiler.close()
        self.inputs.close()
        self.watch.close()
        try:
            self.ckpt.wait()  # CheckpointWriteError if the last save failed
        finally:
            self.run.close()
            self.writer.close(publish=not self.owner.lost())  # never overwrite the metrics of a run that took over


class _Heartbeat:
    """A short progress line ('step 13/200, ETA 4m10s') when EVERY_S seconds have passed since the last line, so
    a person sees the run move between the train.log_every lines (10 steps of the tiny config take 30 s or more
    on a CPU). The ETA is the mean step time since the first step (its compilation left out)."""

    EVERY_S = 15.0

    def __init__(self, total: int, clock=time.monotonic):
        self.total, self.clock = total, clock
        self.last = self.first = clock()
        self.first_step = None

    def started(self, step: int) -> None:
        self.first_step, self.first = step, self.clock()
        self.last = self.first

    def logged(self) -> None:
        self.last = self.clock()

    def beat(self, step: int) -> None:
        now = self.clock()
        if self.first_step is None or step <= self.first_step or now - self.last < self.EVERY_S:
            return  # no step time measured yet, or a line not long ago
        self.last = now
        eta = (now - self.first) / (step - self.first_step) * (self.total - step)
        logging.info("step %d/%d, ETA %dm%02ds", step, self.total, eta // 60, eta % 60)


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


def _save_after_input_failure(run, step, state, pending, writer):
    writer.write_steps(pending.flush())
    run.save(step, state)
    run.checkpointer.wait()


class _Inputs:
    """Host batches -> (host figures, device arrays), timing how long the loop waits for them.

    wait_fraction() is the share of wall time since its last call that the loop spent here
    (building or waiting for the batch, and starting its transfer); above WAIT_WARNING it
    logs what to change, the first time and then every WARN_EVERY calls."""

    WAIT_WARNING, WARN_EVERY = 0.10, 50

    def __init__(self, dataset, mesh, workers: int, sources_: tuple[str, ...] = ()):
        self._iter, self._mesh, self._workers = iter(dataset), mesh, workers
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
        if host_batch.fgram_tokens is not None:  # SCONE's batcher (Over-Encoding's adds ids only)
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
