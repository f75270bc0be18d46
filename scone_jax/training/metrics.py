"""Where metrics go: the log, TensorBoard event files and a JSONL file, from process 0 only.

With a gs:// workdir the event files and metrics.jsonl grow in a local staging directory and are
copied to the workdir every `upload_every_s` seconds and at close (object stores cannot append).
A resumed run first fetches the workdir's metrics.jsonl, so the file keeps one history, and drops
the records of steps after the checkpoint it resumed from (a run that died between checkpoints
logged steps that the resumed run does again): one record per step, however often a run restarts.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

from absl import logging

from scone_jax.runtime import storage, workdir as workdir_layout

METRICS_FILE = workdir_layout.METRICS


class MetricsWriter:
    """One `write(step, scalars)` call fans out to all three sinks. `resume_step` (the step a run
    starts from, 0 for a fresh one) drops the existing records of later steps; None keeps all."""

    def __init__(self, workdir: str, enabled: bool = True, upload_every_s: float = 60.0,
                 resume_step: int | None = None):
        self.enabled = enabled
        self._tb = self._jsonl = self._mirror = None
        if not enabled:
            return
        local = workdir
        if storage.is_remote(workdir):
            local = tempfile.mkdtemp(prefix="scone_jax_metrics-")
            previous = storage.read_bytes(workdir, METRICS_FILE)
        else:
            previous = storage.read_file(os.path.join(local, METRICS_FILE))
        os.makedirs(local, exist_ok=True)
        if previous is not None and resume_step is not None:  # written whole, then renamed: a crash here leaves the old file
            with open(os.path.join(local, METRICS_FILE + ".tmp"), "wb") as f:
                f.write(records_up_to(previous, resume_step))
            os.replace(os.path.join(local, METRICS_FILE + ".tmp"), os.path.join(local, METRICS_FILE))
        if storage.is_remote(workdir):
            self._mirror = storage.DirectoryMirror(local, workdir, upload_every_s)
        self._local = local
        self._jsonl = open(os.path.join(local, METRICS_FILE), "a")

    def _event_writer(self):
        """The TensorBoard writer, made at the first write: importing tensorboardX takes most of a
        second, which a restarted job would otherwise spend before its first step."""
        if self._tb is None:
            from tensorboardX import SummaryWriter

            # Event files are named by host and second only; the suffix keeps a quick restart from
            # replacing (on GCS: overwriting) the previous run's file.
            self._tb = SummaryWriter(os.path.join(self._local, workdir_layout.TENSORBOARD),
                                     filename_suffix=f".{uuid.uuid4().hex[:8]}")
        return self._tb

    def write(self, step: int, scalars: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        tb = self._event_writer()
        for name, value in scalars.items():
            tb.add_scalar(f"{prefix}/{name}", float(value), step)
        self._jsonl.write(json.dumps({"step": step, "split": prefix, **{k: float(v) for k, v in scalars.items()}}) + "\n")
        self._jsonl.flush()

    def write_steps(self, records: list[dict]) -> None:
        """Per-step records (loss, batch fingerprint): the trail that resume tests compare."""
        if not self.enabled:
            return
        for record in records:
            self._jsonl.write(json.dumps({"split": "step", **record}) + "\n")
        self._jsonl.flush()

    def close(self, publish: bool = True) -> None:
        """Close the sinks and make the workdir's copy complete. publish=False (the run lost its
        workdir to another run) leaves the workdir's copy alone and keeps the local one."""
        if self.enabled:
            if self._tb is not None:
                self._tb.close()
            self._jsonl.close()
            if self._mirror is not None:
                if self._mirror.close(upload=publish):
                    shutil.rmtree(self._mirror.local, ignore_errors=True)
                else:
                    logging.warning("Metrics are not all in %s; the local copy stays in %s",
                                    self._mirror.remote, self._mirror.local)


def records_up_to(jsonl: bytes, step: int) -> bytes:
    """The lines of a metrics.jsonl whose step is at most `step` (a torn last line is dropped too)."""
    kept = []
    for line in jsonl.splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
        except (ValueError, KeyError, TypeError):
            continue
    return b"".join(kept)


def format_line(step: int, total: int, scalars: dict) -> str:
    """Human progress line: step, loss, perplexity, tokens/s, ETA, MFU, share of time waiting for input."""
    eta = scalars.get("eta_s", 0.0)
    line = (
        f"step {step}/{total} loss {scalars['loss']:.4f} ppl {scalars['perplexity']:.2f} "
        f"tok/s {scalars['tokens_per_s']:,.0f} mfu {100 * scalars['mfu']:.2f}% "
        f"grad_norm {scalars['grad_norm']:.3f} lr {scalars['learning_rate']:.2e} "
        f"eta {int(eta // 60)}m{int(eta % 60):02d}s"
    )
    if "input_wait_fraction" in scalars:
        line += f" input_wait {100 * scalars['input_wait_fraction']:.0f}%"
    mix = {k[len("mix/tokens_"):]: v for k, v in scalars.items() if k.startswith("mix/tokens_")}
    if mix:  # each mixture component's share of the window's tokens
        total = sum(mix.values()) or 1.0
        line += " | mix " + " ".join(f"{name} {v / total:.2f}" for name, v in mix.items())
    if "fgram/hit_rate" in scalars:
        line += (
            f" | fgram hit {scalars['fgram/hit_rate']:.3f} len {scalars['fgram/mean_matched_length']:.2f} "
            f"unique {scalars['fgram/unique_ratio']:.3f} rows {scalars['fgram/row_ratio']:.3f} model_tok/step {scalars['fgram/model_tokens']:,.0f}"
        )
        if "fgram/model_grad_norm" in scalars:
            line += f" grad {scalars['fgram/model_grad_norm']:.3f}"
    return line
