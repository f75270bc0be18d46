"""Where metrics go: the log, TensorBoard event files and a JSONL file, from process 0 only."""
from __future__ import annotations

import json
import os



class MetricsWriter:
    """One `write(step, scalars)` call fans out to all three sinks."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        if enabled:
            from tensorboardX import SummaryWriter

            os.makedirs(workdir, exist_ok=True)
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")

    def write(self, step: int, scalars: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self._tb.add_scalar(f"{prefix}/{name}", float(value), step)
        self._jsonl.write(json.dumps({"step": step, "split": prefix, **{k: float(v) for k, v in scalars.items()}}) + "\n")
        self._jsonl.flush()

    def write_steps(self, records: list[dict]) -> None:
        """Per-step records (loss, batch fingerprint): the trail that resume tests compare."""
        if not self.enabled:
            return
        for record in records:
            self._jsonl.write(json.dumps({"split": "step", **record}) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        if self.enabled:
            self._tb.close()
            self._jsonl.close()


def format_line(step: int, total: int, scalars: dict) -> str:
    """Human progress line: step, loss, perplexity, tokens/s, ETA, MFU."""
    eta = scalars.get("eta_s", 0.0)
    line = (
        f"step {step}/{total} loss {scalars['loss']:.4f} ppl {scalars['perplexity']:.2f} "
        f"tok/s {scalars['tokens_per_s']:,.0f} mfu {100 * scalars['mfu']:.2f}% "
        f"grad_norm {scalars['grad_norm']:.3f} lr {scalars['learning_rate']:.2e} "
        f"eta {int(eta // 60)}m{int(eta % 60):02d}s"
    )
    if "fgram/hit_rate" in scalars:
        line += (
            f" | fgram hit {scalars['fgram/hit_rate']:.3f} len {scalars['fgram/mean_matched_length']:.2f} "
            f"unique {scalars['fgram/unique_ratio']:.3f} rows {scalars['fgram/row_ratio']:.3f} model_tok/step {scalars['fgram/model_tokens']:,.0f}"
        )
    return line
