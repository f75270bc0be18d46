"""Export a trained SCONE run for inference: `python -m scone_jax.serving.export --workdir=RUN --output=PATH`.
(With --format=hf: its decoder as a stock Hugging Face checkpoint instead, serving/hf_export.py; a SCONE run's
inside a transformers remote-code model with its f-gram table, serving/hf_remote.py.)

Runs the f-gram model once over all S f-grams (docs/method.md §6) in large batches sharded over every
device of every process, and writes the bundle described in scone_jax/serving/bundle.py (PATH local or
gs://). The table is written in files of --chunk_rows rows (serving/table_layout.py): in each round
every device computes one whole file, --batch_rows / devices rows per step, and the process that
holds it writes it as one object, so writers never overlap and GCS needs no partial writes. Writing
is asynchronous: while tensorstore writes a round's files, the devices compute the next.
Rerunning an interrupted export skips the rounds whose files all carry done markers; COMPLETE is
written last, with the checksums readers verify (bundle.py). Rerunning a finished export repairs it:
if a done marker was deleted (what readers ask for when a piece is missing or damaged) or
tokenizer.model differs from the run's, COMPLETE is withdrawn and those pieces are rewritten.
A run trained without SCONE (a baseline) exports the same bundle with an empty f-gram set (S = 0: a
table of no rows), so it is served, evaluated and compared by exactly the same programs.
PATH must be new, empty or an export (serving/output_dir.py): anything else there is refused before a byte is
written, and export.json is the first file written, so a stopped export is always recognised as one.
Exit status: 0 done, 2 bad input (no checkpoint, a different export or anything else at PATH, peers that never
arrived), 130 / 143 stopped by SIGINT / SIGTERM (one line says how many chunks are kept; rerunning resumes).

On a pod, run the same command on every host (like training: the Cloud TPU environment is detected,
elsewhere pass --coordinator_address, --num_processes and --process_id); every device computes rows
and each process writes its own. The table does not depend on the process count.
"""
from __future__ import annotations

import collections
import json
import math
import time
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import flags, logging
from flax import nnx
from jax.experimental import multihost_utils

from scone_jax import sharding
from scone_jax.fgram.vocab import PAD, FgramVocab, save_vocab
from scone_jax.runtime import (compile_cache, distributed, job_flags, logs, ownership, storage, tool_main,
                               write_probe)
from scone_jax.runtime.compile_cache import CompileCache
from scone_jax.runtime.crc import crc32_hex
from scone_jax.runtime.errors import one_line
from scone_jax.runtime.prefetch import DispatchWindow
from scone_jax.saved_config import run_config
from scone_jax.serving import bundle, output_dir, table_layout
from scone_jax.training import checkpoint, run as run_lib

_MAX_PENDING_WRITES = 3
_VOCAB_DONE, _DECODER_DONE = f"{bundle.DONE}/{bundle.FGRAMS}", f"{bundle.DONE}/{bundle.DECODER}"
_DECODER_SAVING = bundle.DECODER + ".orbax-checkpoint-tmp"  # orbax's name for decoder/ while it saves it


def open_run(workdir: str, config: ml_collections.ConfigDict | None = None,
             latest: run_lib.Latest | None = None) -> run_lib.Run:
    """A training run's latest checkpoint, restored as training/run.py builds a run (start=Latest: the tokenizer
    and vocabulary it was trained with, as they are) over its config's mesh. `config`: the checkpoint's own
    by default."""
    latest = latest or run_lib.Latest.open(workdir)
    config = config or run_config(latest.meta)
    try:
        return run_lib.build(config, workdir, sharding.make_mesh(config.mesh), start=latest)
    except checkpoint.CheckpointDamagedError as e:
        owner = ownership.live_owner(workdir)
        if owner is None:
            raise
        raise ValueError(
            f"Checkpoint {latest.checkpointer.directory}/{latest.step} could not be read while a live run owns "
            f"{workdir} ({owner}): that run removes older checkpoints as it saves newer ones, so it may have "
            f"deleted this one under the export ({one_line(e.__cause__ or e, 300)}). Fix: rerun the export, which takes the newest "
            "checkpoint, or export once that run has finished.") from e


def embed_fn(model, mesh, dtype: str):
    """jit(tokens [B, K], lengths [B]) -> f-gram embeddings [B, d] in the table dtype, rows sharded
    like the inputs. The cast happens on the device, so bf16 halves the transfer to the host."""
    graphdef, params = nnx.split(model)
    out = jnp.dtype(dtype)

    @jax.jit
    def embed(params, tokens, lengths):
        return nnx.merge(graphdef, params).fgram_embeddings(tokens, lengths).astype(out)

    run = sharding.under_mesh(mesh, embed)
    return lambda tokens, lengths: run(params, tokens, lengths)


def batch_inputs(vocab: FgramVocab, start: int, rows: int, mesh):
    """Global [rows, K] tokens and [rows] lengths for table rows start.. (see rows_inputs)."""
    return rows_inputs(vocab, np.arange(start, start + rows), mesh)


def rows_inputs(vocab: FgramVocab, rows: np.ndarray, mesh):
    """Global [len(rows), K] tokens and lengths for table rows `rows`, sharded by rows; a row outside the
    table (-1, or past S) is a 2-token PAD f-gram (computed, never written). Each process builds only its
    own shards."""
    real = (rows >= 0) & (rows < vocab.num_fgrams)
    tokens = np.full((len(rows), vocab.max_len), PAD, np.int32)
    tokens[real] = vocab.tokens[rows[real]]
    lengths = np.full(len(rows), 2, np.int32)
    lengths[real] = vocab.lengths[rows[real]]
    put = lambda a: jax.make_array_from_callback(  # noqa: E731
        a.shape, sharding.batch_sharding(mesh), lambda index: a[index])
    return put(tokens), put(lengths)


def round_rows(layout: table_layout.Layout, shards: int, per_device: int, round_: int, step: int) -> np.ndarray:
    """The table rows of one step of a round: batch shard j computes rows step * per_device.. of file
    round_ * shards + j; -1 past the end of that file."""
    chunk = round_ * shards + np.arange(shards)[:, None]
    rows = chunk * layout.chunk_rows + step * per_device + np.arange(per_device)[None, :]
    end = np.minimum((chunk + 1) * layout.chunk_rows, layout.num_rows)
    return np.where(rows < end, rows, -1).reshape(-1)


class _Progress:
    def __init__(self, total: int, done: int, every_s: float):
        self.total, self.done, self.every_s = total, done, every_s
        self.start = self.last = time.time()
        self.computed = 0

    def add(self, rows: int):
        self.computed += rows
        now = time.time()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.computed / max(now - self.start, 1e-9)
            remaining = self.total - self.done - self.computed
            logging.info("export: %s/%s rows (%.1f%%), %.0f rows/s, ETA %.0f s", f"{self.done + self.computed:,}",
                         f"{self.total:,}", 100 * (self.done + self.computed) / self.total, rate,
                         remaining / max(rate, 1e-9))


class TableWriter:
    """Collects the rows this process's devices computed for each table file over a round's steps, and writes
    each file whole, asynchronously (one object: local disk and GCS alike); marks it done once committed."""

    def __init__(self, output: str, layout: table_layout.Layout, shards: int, per_device: int, skip: set[int]):
        self.store, self.layout = storage.open_store(output), layout
        self.shards, self.per_device, self.skip = shards, per_device, skip
        self.rows: dict[int, np.ndarray] = {}
        self.pending = collections.deque()

    def add(self, round_: int, step: int, result: jax.Array) -> None:
        """The rows of `result` (round_rows of this round and step) held by this process, done files skipped."""
        for shard in result.addressable_shards:
            if shard.replica_id != 0:
                continue
            c = round_ * self.shards + (shard.index[0].start or 0) // self.per_device
            if c >= self.layout.num_chunks or c in self.skip:
                continue
            lo, hi = self.layout.rows_of_chunk(c)
            a, b = step * self.per_device, min((step + 1) * self.per_device, hi - lo)
            if a >= b:
                continue
            rows = self.rows.setdefault(c, np.empty((hi - lo, self.layout.width), self.layout.dtype))
            rows[a:b] = np.asarray(shard.data)[:b - a]
            if b == hi - lo:  # the file is complete: its CRCs are taken from these rows, in memory
                data, rows_crc, index_crc = self.layout.encode(self.rows.pop(c))
                self.pending.append((c, f"{rows_crc} {index_crc}", self.store.write(bundle.chunk_key(c), data)))
        while len(self.pending) > _MAX_PENDING_WRITES or (self.pending and self.pending[0][2].done()):
            self._finish_oldest()

    def _finish_oldest(self):
        c, marker, future = self.pending.popleft()
        future.result()
        self.store.write(bundle.done_key(c), marker.encode()).result()

    def flush(self):
        while self.pending:
            self._finish_oldest()


def done_chunks(output: str) -> set[int]:
    """Chunks with a done marker, as process 0 sees them (all processes must skip the same batches)."""
    keys = [k.decode() for k in storage.open_store(storage.join(output, bundle.DONE)).list().result()]
    local = np.array(sorted(int(k) for k in keys if k.isdigit()), np.int64)
    count = int(multihost_utils.broadcast_one_to_all(np.int64(len(local))))
    if count == 0:
        return set()
    padded = np.full(count, -1, np.int64)
    padded[: min(len(local), count)] = local[:count]
    return set(int(c) for c in multihost_utils.broadcast_one_to_all(padded))


def _prepare_output(output: str, meta: dict, tokenizer_proto: bytes) -> bool:
    """Check PATH may receive this export; True if it already holds it complete. Never overwrites
    a different export, finished or not. A finished one with a done marker deleted or a tokenizer.model
    other than the run's is under repair: the chief withdraws COMPLETE and the missing pieces get rewritten."""
    existing = bundle.read_export_meta(output)
    if existing is not None and bundle.meta_fingerprint(existing) != bundle.meta_fingerprint(meta):
        differ = sorted(k for k in set(meta) | set(existing) if meta.get(k) != existing.get(k))
        raise bundle.BundleError(
            f"{output!r} already holds an export that differs from this one in {differ}; nothing was "
            "overwritten. Fix: choose another --output, or delete that one first.")
    complete = False  # decided by the chief, for all (a peer may read export.json after the chief wrote it)
    if existing is not None and jax.process_index() == 0 and storage.read_bytes(output, bundle.COMPLETE) is not None:
        markers = {k.decode() for k in storage.open_store(storage.join(output, bundle.DONE)).list().result()}
        wanted = {bundle.FGRAMS, bundle.DECODER} | {f"{c:09d}" for c in range(_num_chunks(meta))}
        missing = sorted(wanted - markers)
        tokenizer_ok = storage.read_bytes(output, bundle.TOKENIZER) == tokenizer_proto
        complete = not missing and tokenizer_ok
        if not complete:
            logging.info("export: repairing %s (done markers missing: %s; %s %s)", output, missing[:5] or "none",
                         bundle.TOKENIZER, "as the run's" if tokenizer_ok else "differs from the run's")
            complete_key = ts.KvStore.KeyRange(bundle.COMPLETE, bundle.COMPLETE + "\0")
            storage.open_store(output).delete_range(complete_key).result()  # readers refuse it until repaired
    return bool(multihost_utils.broadcast_one_to_all(np.int32(complete)))


def _num_chunks(meta: dict) -> int:
    return math.ceil(meta["num_fgrams"] / meta["chunk_rows"])


def _layout(meta: dict) -> table_layout.Layout:
    return table_layout.Layout.of_meta(meta, bundle.numpy_dtype(meta["dtype"]))


def _complete_marker(output: str, meta: dict, tokenizer_proto: bytes) -> bytes:
    """COMPLETE: the CRCs the done markers hold (table files' rows and block indexes, decoder files) and
    tokenizer.model's."""
    store = storage.open_store(output)
    keys = [bundle.done_key(c) for c in range(_num_chunks(meta))] + [_DECODER_DONE]
    values = {key: read.result() for key, read in [(key, store.read(key)) for key in keys]}
    for key, value in values.items():
        if value.state != "value":  # every process flushed its writes before this runs
            raise bundle.BundleError(f"{storage.join(output, key)} vanished while the export ran. Fix: rerun it.")
    table = [bytes(values[key].value).decode().split() for key in keys[:-1]]
    files = json.loads(bytes(values[_DECODER_DONE].value)) | {bundle.TOKENIZER: crc32_hex(tokenizer_proto)}
    return bundle.complete_marker(meta, [t[0] for t in table], [t[1] for t in table], files)


def claim_output(output: str) -> bool:
    """Whether `output` holds an export already (resumed, repaired or refused by _prepare_output); False if it is
    missing or empty. Anything else there is refused (serving/output_dir.py)."""
    return output_dir.claim(output, names=bundle.PIECES, prefixes=(_DECODER_SAVING,), marker=bundle.META,
                            is_ours=bundle.is_export_meta, kind="a scone_jax export")


def export(workdir: str, output: str, *, config=None, dtype: str = "bfloat16", chunk_rows: int = 65536,
           batch_rows: int = 8192, log_every_s: float = 10.0) -> dict:
    """Export the latest checkpoint of `workdir` into `output`; returns figures of the run. Bad arguments, an
    output that holds anything but an export (output_dir.py) and one that cannot be written are refused before
    any work (and before anything is written there)."""
    workdir, output = storage.resolved(workdir), storage.resolved(output)  # '../x' too (storage.resolved)
    bundle.numpy_dtype(dtype)
    for name, value in (("chunk_rows", chunk_rows), ("batch_rows", batch_rows)):
        if value < 1:
            raise ValueError(f"--{name}={value} must be at least 1 (table rows per file / f-grams per step).")
    if storage.is_remote(output):  # the probe answers within its deadline where a bucket cannot be reached
        write_probe.check_writable(output, 120, flag="--output")
    claim_output(output)
    if not storage.is_remote(output):  # (locally the probe writes into the directory: only once it is ours)
        write_probe.check_writable(output, 120, flag="--output")
    latest = run_lib.Latest.open(workdir)
    config = config or run_config(latest.meta)
    cache = CompileCache(compile_cache.resolve(config.train.compilation_cache_dir, workdir))
    run = None
    try:
        run = open_run(workdir, config, latest)
        mesh, model, scone = run.mesh, run.model(), config.scone.enabled
        decoder_params = nnx.state(model.decoder if scone else model, nnx.Param)
        vocab = run.vocab if run.vocab is not None else FgramVocab.empty(config.model.vocab_size,
                                                                         run.tokenizer.fingerprint)
        meta = {
            "format": bundle.FORMAT, "version": bundle.VERSION, "num_fgrams": vocab.num_fgrams,
            "d_model": config.model.d_model, "max_len": vocab.max_len, "dtype": dtype, "chunk_rows": chunk_rows,
            "block_rows": table_layout.block_rows_for(config.model.d_model * bundle.numpy_dtype(dtype).itemsize,
                                                      chunk_rows),
            "model_fingerprint": bundle.params_fingerprint(decoder_params),
            "fgram_model_fingerprint": bundle.params_fingerprint(nnx.state(model.fgram_model, nnx.Param))
                                       if scone else None,
            "step": run.step, "config": config.to_dict(), **run.expect,
            "fgram_vocab_fingerprint": vocab.fingerprint,
        }
        if _prepare_output(output, meta, run.tokenizer.proto):
            logging.info("export: %s is already complete", output)
            return {"rows_computed": 0, "seconds": 0.0, "rows_per_s": 0.0, "meta": meta}
        chief = jax.process_index() == 0
        if chief:  # first: what says whose export this is, so a rerun may resume (output_dir.py)
            storage.write_bytes(output, bundle.META, json.dumps(meta, indent=1).encode())
        if chief and storage.read_bytes(output, _VOCAB_DONE) is None:
            save_vocab(vocab, storage.join(output, bundle.FGRAMS))
            storage.write_bytes(output, _VOCAB_DONE, b"1")
        if chief:
            # Tokenizer.proto: a .model's bytes, or a tokenizer.json wrapped with the run's special ids.
            storage.write_bytes(output, bundle.TOKENIZER, run.tokenizer.proto)
        multihost_utils.sync_global_devices("scone_export_created")
        saver = None
        if storage.read_bytes(output, _DECODER_DONE) is None:  # saved asynchronously while the table computes
            saver = bundle.decoder_checkpointer()
            saver.save(storage.join(output, bundle.DECODER), args=ocp.args.StandardSave(decoder_params), force=True)
        figures = _write_table(model, mesh, vocab, output, meta, batch_rows, log_every_s)
        if saver is not None:
            saver.wait_until_finished()
            saver.close()
        multihost_utils.sync_global_devices("scone_export_written")
        if chief:
            if saver is not None:  # the CRCs of the files just saved, read back once
                decoder_sums = bundle.file_checksums(output, bundle.DECODER)
                storage.write_bytes(output, _DECODER_DONE, json.dumps(decoder_sums, indent=0).encode())
            storage.write_bytes(output, bundle.COMPLETE, _complete_marker(output, meta, run.tokenizer.proto))
        return {**figures, "meta": meta}
    finally:
        cache.close()
        if run is not None:
            run.close()


def _write_table(model, mesh, vocab, output, meta, batch_rows, log_every_s) -> dict:
    """The table's files, round by round (round_rows); rounds whose files are all done are skipped."""
    layout = _layout(meta)
    shards = sharding.num_batch_shards(mesh)
    per_device = max(1, min(layout.chunk_rows, batch_rows // shards))
    steps = math.ceil(layout.chunk_rows / per_device)
    total, per_round = layout.num_rows, shards * layout.chunk_rows
    done = done_chunks(output)
    todo = [r for r in range(math.ceil(layout.num_chunks / shards))
            if not all(c in done for c in range(r * shards, min((r + 1) * shards, layout.num_chunks)))]
    writer = TableWriter(output, layout, shards, per_device, done)
    embed = embed_fn(model, mesh, meta["dtype"])
    rows_of = lambda r: min(total, (r + 1) * per_round) - r * per_round  # noqa: E731
    progress = _Progress(total, total - sum(rows_of(r) for r in todo), log_every_s)
    if todo:  # compile before the clock starts, so rows/s and the ETA are the steady rate
        jax.block_until_ready(embed(*rows_inputs(vocab, round_rows(layout, shards, per_device, todo[0], 0), mesh)))
    start_time, in_flight = time.time(), None
    window = DispatchWindow(mesh)
    for r in todo:
        for step in range(steps):
            rows = round_rows(layout, shards, per_device, r, step)
            result = window.add(embed(*rows_inputs(vocab, rows, mesh)))  # dispatched; runs while we write
            if in_flight is not None:
                writer.add(*in_flight[:3])
                progress.add(in_flight[3])
            in_flight = (r, step, result, int((rows >= 0).sum()))
    if in_flight is not None:
        writer.add(*in_flight[:3])
        progress.add(in_flight[3])
    writer.flush()
    seconds = time.time() - start_time
    computed = sum(rows_of(r) for r in todo)
    logging.info("export: computed %s rows in %.1f s (%.0f rows/s)", f"{computed:,}", seconds,
                 computed / max(seconds, 1e-9))
    return {"rows_computed": computed, "seconds": seconds, "rows_per_s": computed / max(seconds, 1e-9)}


def stopped_note(output: str) -> str:
    """What a SIGINT or SIGTERM leaves at `output` and how to go on (tool_main prints it). Chunks are marked done
    only once written, and COMPLETE comes last, so a stopped export is unfinished, never wrong: readers refuse it
    and a rerun computes only the chunks without a marker."""
    try:
        meta = bundle.read_export_meta(output)
        if meta is not None and storage.read_bytes(output, bundle.COMPLETE) is not None:
            return f"{output} was already complete."
        keys = storage.open_store(storage.join(output, bundle.DONE)).list().result() if meta is not None else []
    except Exception as e:  # noqa: BLE001 - the stop's line must come out whatever the storage says now
        return f"could not read what is at {output} ({one_line(e, 200)}). Rerun the same command to resume."
    if meta is None:
        return f"no table chunk was written to {output} yet. Rerun the same command to export."
    done, total = sum(k.decode().isdigit() for k in keys), _num_chunks(meta)
    rest = "it computes only the rest" if done < total else "no chunk is computed again"
    return (f"{done} of {total} table chunks are written to {output} and kept; readers refuse it until it is "
            f"complete. Rerun the same command to resume: {rest}.")


def _define_flags():
    """Command-line flags, defined only when this module runs as a program (modules share absl's registry)."""
    workdir = flags.DEFINE_string("workdir", None, "Training run directory (checkpoints/, tokenizer, fgrams).")
    output = flags.DEFINE_string("output", None, "Bundle directory: a local path or gs://bucket/path.")
    dtype = flags.DEFINE_enum("dtype", "bfloat16", list(bundle.DTYPES), "Table dtype.")
    chunk_rows = flags.DEFINE_integer("chunk_rows", 65536, "Table rows per file (256 MiB at d=2048 in bf16): the unit "
                                      "a process writes and an interrupted export resumes from.")
    batch_rows = flags.DEFINE_integer("batch_rows", 8192, "F-grams per step over all devices (at most one file per "
                                      "device).")
    kind = flags.DEFINE_enum("format", "bundle", ["bundle", "hf"], "bundle: this package's export (the table, "
                             "the decoder, the tokenizer); hf: the decoder as a stock Hugging Face checkpoint of its "
                             "family, for transformers (serving/hf_export.py; --dtype then sets its tensors' dtype, by "
                             "default the imported checkpoint's or model.param_dtype); a SCONE run's goes inside a "
                             "trust_remote_code model with its f-gram table (--dtype sets the table's too; bf16 by default).")
    join = job_flags.define()
    flags.adopt_module_key_flags(job_flags)  # listed by --help
    return types.SimpleNamespace(workdir=workdir, output=output, dtype=dtype, chunk_rows=chunk_rows,
                                 batch_rows=batch_rows, join=join, format=kind)


def run(args):
    logs.quiet_libraries()
    tool_main.require(workdir=args.workdir.value, output=args.output.value)
    distributed.initialize(args.join.spec())
    if args.format.value == "hf":
        from scone_jax.serving import hf_export

        meta = hf_export.export_hf(args.workdir.value, args.output.value, batch_rows=args.batch_rows.value,
                                   dtype=args.dtype.value if args.dtype.present else None)
        if jax.process_index() == 0:
            print(f"exported step {meta['step']} as a {meta['family']} checkpoint ({meta['dtype']})"
                  f"{' inside the SCONE remote-code model' if meta.get('remote_code') else ''} to {args.output.value}")
        return
    figures = export(args.workdir.value, args.output.value, dtype=args.dtype.value, chunk_rows=args.chunk_rows.value,
                     batch_rows=args.batch_rows.value)
    if jax.process_index() == 0:
        print(f"exported {figures['meta']['num_fgrams']:,} f-grams to {args.output.value} "
              f"({figures['rows_per_s']:.0f} rows/s)")


if __name__ == "__main__":
    _args = _define_flags()
    tool_main.run(lambda: run(_args), program="scone_jax.serving.export",
                  errors=(*tool_main.BAD_INPUT, distributed.DistributedStartError),
                  stopped=lambda: stopped_note(_args.output.value))
