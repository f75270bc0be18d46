"""Export a trained SCONE run for inference: `python -m scone_jax.serving.export --workdir=RUN --output=PATH`.

Runs the f-gram model once over all S f-grams (docs/method.md §6) in large batches sharded over every
device of every process, and writes the bundle described in scone_jax/serving/bundle.py (PATH local or
gs://). Each process writes the rows its own devices computed, in whole table chunks, so writers
never overlap. Writing is asynchronous: while tensorstore writes batch g, the devices compute g+1.
Rerunning an interrupted export skips the batches whose chunks all carry done markers; COMPLETE is
written last, with the checksums readers verify (bundle.py). Rerunning a finished export repairs it:
if a done marker was deleted (what readers ask for when a piece is missing or damaged) or
tokenizer.model differs from the run's, COMPLETE is withdrawn and those pieces are rewritten.
A run trained without SCONE (a baseline) exports the same bundle with an empty f-gram set (S = 0: a
table of no rows), so it is served, evaluated and compared by exactly the same programs.
Exit status: 0 done, 2 bad input (no checkpoint, a different export at PATH, peers that never arrived), 130 / 143
stopped by SIGINT / SIGTERM (one line says how many chunks are kept; rerunning resumes).

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
from scone_jax.data.tokenizer import Tokenizer, special_tokens_of
from scone_jax.fgram.vocab import PAD, FgramVocab, load_vocab, save_vocab
from scone_jax.runtime import (compile_cache, distributed, job_flags, logs, ownership, storage, tool_main,
                               workdir as workdir_layout, write_probe)
from scone_jax.runtime.compile_cache import CompileCache
from scone_jax.runtime.errors import one_line
from scone_jax.serving import bundle
from scone_jax.serving.prefetch import DispatchWindow
from scone_jax.training import checkpoint, state as state_lib

_MAX_PENDING_WRITES = 3
_VOCAB_DONE, _DECODER_DONE = f"{bundle.DONE}/{bundle.FGRAMS}", f"{bundle.DONE}/{bundle.DECODER}"


class Run:
    """A training run's latest checkpoint with the tokenizer and vocabulary it was trained with (an empty
    vocabulary for a run without SCONE)."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict | None = None):
        self.workdir = workdir
        self.checkpointer = checkpoint.Checkpointer(workdir_layout.path(workdir, workdir_layout.CHECKPOINTS))
        self.step = self.checkpointer.latest_step()
        if self.step is None:
            raise FileNotFoundError(f"No checkpoint in {workdir}/checkpoints. Fix: train first "
                                    f"(python -m scone_jax.main --workdir={workdir}).")
        meta = self.checkpointer.read_checkpoint_meta(self.step)
        self.config = config or bundle.stored_config(meta["config"])
        d = self.config.data
        # The run's special-id policy too: the fingerprint (and the ids the bundle stores) must be the run's.
        self.tokenizer = Tokenizer.load(d.tokenizer_path or workdir_layout.path(workdir, workdir_layout.TOKENIZER),
                                        special_tokens_of(d))
        if self.config.scone.enabled:
            self.vocab = load_vocab(self.config.scone.vocab_path or workdir_layout.path(workdir, workdir_layout.FGRAMS),
                                    expected_tokenizer_fingerprint=self.tokenizer.fingerprint)
        else:
            self.vocab = FgramVocab.empty(self.config.model.vocab_size, self.tokenizer.fingerprint)
        self.expect = {"tokenizer_fingerprint": self.tokenizer.fingerprint,
                       "fgram_vocab_fingerprint": self.vocab.fingerprint if self.config.scone.enabled else None}

    def restore_model(self, mesh) -> nnx.Module:
        """The model of the latest checkpoint (SconeModel, or the Decoder of a run without SCONE), its arrays
        in the run's shardings (optimizer dropped)."""
        spec = state_lib.state_spec(self.config, mesh)
        try:
            state, _ = state_lib.restore(self.checkpointer, self.step, self.config, spec, mesh, expect=self.expect)
        except checkpoint.CheckpointDamagedError as e:
            owner = ownership.live_owner(self.workdir)
            if owner is None:
                raise
            raise ValueError(
                f"Checkpoint {self.checkpointer.directory}/{self.step} could not be read while a live run owns "
                f"{self.workdir} ({owner}): that run removes older checkpoints as it saves newer ones, so it may have "
                f"deleted this one under the export ({one_line(e.__cause__ or e, 300)}). Fix: rerun the export, which takes the newest "
                "checkpoint, or export once that run has finished.") from e
        return state_lib.model_of(spec.graphdef, state)

    def close(self):
        self.checkpointer.close()


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
    """Global [rows, K] tokens and [rows] lengths for table rows start.., padded past S with a
    2-token PAD f-gram (computed, never written). Each process builds only its own shards."""
    stop = min(start + rows, vocab.num_fgrams)
    tokens = np.full((rows, vocab.max_len), PAD, np.int32)
    tokens[: stop - start] = vocab.tokens[start:stop]
    lengths = np.full(rows, 2, np.int32)
    lengths[: stop - start] = vocab.lengths[start:stop]
    put = lambda a: jax.make_array_from_callback(  # noqa: E731
        a.shape, sharding.batch_sharding(mesh, a.ndim), lambda index: a[index])
    return put(tokens), put(lengths)


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
    """Writes this process's rows of each batch asynchronously; marks chunks done once committed."""

    def __init__(self, table: ts.TensorStore, output: str, chunk_rows: int, num_rows: int):
        self.table, self.store = table, storage.open_store(output)
        self.chunk_rows, self.num_rows = chunk_rows, num_rows
        self.pending = collections.deque()

    def write(self, start: int, result: jax.Array, skip: set[int]) -> None:
        """Queue the rows of `result` (batch rows start..) held by this process, skipping done chunks.
        Each shard holds whole chunks (_write_table sizes batches so), and each chunk's CRC is taken
        here from the rows in memory: what readers check is what the f-gram model computed."""
        for shard in result.addressable_shards:
            if shard.replica_id != 0:
                continue
            lo = start + (shard.index[0].start or 0)
            hi = min(lo + shard.data.shape[0], self.num_rows)
            chunks = [c for c in range(lo // self.chunk_rows, math.ceil(hi / self.chunk_rows)) if c not in skip]
            if hi <= lo or not chunks:
                continue
            rows = np.asarray(shard.data)[: hi - lo]
            sums = {c: bundle.array_checksum(rows[c * self.chunk_rows - lo:min((c + 1) * self.chunk_rows, hi) - lo])
                    for c in chunks}
            futures = self.table[lo:hi].write(rows)
            self.pending.append((sums, futures))
        while len(self.pending) > _MAX_PENDING_WRITES or (self.pending and self.pending[0][1].commit.done()):
            self._finish_oldest()

    def _finish_oldest(self):
        sums, futures = self.pending.popleft()
        futures.commit.result()
        for f in [self.store.write(bundle.done_key(c), crc.encode()) for c, crc in sums.items()]:
            f.result()

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


def _complete_marker(output: str, meta: dict, tokenizer_proto: bytes) -> bytes:
    """COMPLETE: the CRCs the done markers hold (chunks, decoder files) and tokenizer.model's."""
    store = storage.open_store(output)
    keys = [bundle.done_key(c) for c in range(_num_chunks(meta))] + [_DECODER_DONE]
    values = {key: read.result() for key, read in [(key, store.read(key)) for key in keys]}
    for key, value in values.items():
        if value.state != "value":  # every process flushed its writes before this runs
            raise bundle.BundleError(f"{storage.join(output, key)} vanished while the export ran. Fix: rerun it.")
    table = [bytes(values[key].value).decode() for key in keys[:-1]]
    files = json.loads(bytes(values[_DECODER_DONE].value)) | {bundle.TOKENIZER: bundle.array_checksum(tokenizer_proto)}
    return bundle.complete_marker(meta, table, files)


def export(workdir: str, output: str, *, config=None, dtype: str = "bfloat16", chunk_rows: int = 1024,
           batch_rows: int = 8192, log_every_s: float = 10.0) -> dict:
    """Export the latest checkpoint of `workdir` into `output`; returns figures of the run. Bad arguments and an
    output that cannot be written are refused before any work (and before anything is written there)."""
    bundle.numpy_dtype(dtype)
    for name, value in (("chunk_rows", chunk_rows), ("batch_rows", batch_rows)):
        if value < 1:
            raise ValueError(f"--{name}={value} must be at least 1 (table rows per stored chunk / per device batch).")
    write_probe.check_writable(output, 120, flag="--output")
    run = Run(workdir, config)
    cache = CompileCache(compile_cache.resolve(run.config.train.compilation_cache_dir, workdir))
    try:
        mesh = sharding.make_mesh(run.config.mesh)
        model = run.restore_model(mesh)
        scone = run.config.scone.enabled
        decoder_params = nnx.state(model.decoder if scone else model, nnx.Param)
        vocab = run.vocab
        meta = {
            "format": bundle.FORMAT, "version": bundle.VERSION, "num_fgrams": vocab.num_fgrams,
            "d_model": run.config.model.d_model, "max_len": vocab.max_len, "dtype": dtype, "chunk_rows": chunk_rows,
            "model_fingerprint": bundle.params_fingerprint(decoder_params),
            "fgram_model_fingerprint": bundle.params_fingerprint(nnx.state(model.fgram_model, nnx.Param))
                                       if scone else None,
            "step": run.step, "config": run.config.to_dict(), **run.expect,
            "fgram_vocab_fingerprint": vocab.fingerprint,
        }
        if _prepare_output(output, meta, run.tokenizer.proto):
            logging.info("export: %s is already complete", output)
            return {"rows_computed": 0, "seconds": 0.0, "rows_per_s": 0.0, "meta": meta}
        chief = jax.process_index() == 0
        if chief and storage.read_bytes(output, _VOCAB_DONE) is None:
            # First: save_vocab clears its directory, and a GCS server that ignores listing ranges
            # (the emulator) turns that into clearing the bucket.
            save_vocab(vocab, storage.join(output, bundle.FGRAMS))
            storage.write_bytes(output, _VOCAB_DONE, b"1")
        if chief:
            storage.write_bytes(output, bundle.META, json.dumps(meta, indent=1).encode())
            # Tokenizer.proto: a .model's bytes, or a tokenizer.json wrapped with the run's special ids.
            storage.write_bytes(output, bundle.TOKENIZER, run.tokenizer.proto)
            ts.open(bundle.create_table_spec(output, vocab.num_fgrams, meta["d_model"], dtype, chunk_rows),
                    create=True, open=True).result()
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
        run.close()


def _write_table(model, mesh, vocab, output, meta, batch_rows, log_every_s) -> dict:
    chunk_rows = meta["chunk_rows"]
    unit = sharding.num_batch_shards(mesh) * chunk_rows  # every device's rows are whole chunks
    batch_rows = max(unit, batch_rows // unit * unit)
    total = vocab.num_fgrams
    done = done_chunks(output)
    todo = [s for s in range(0, total, batch_rows)
            if not all(c in done for c in range(s // chunk_rows, math.ceil(min(s + batch_rows, total) / chunk_rows)))]
    table = ts.open(bundle.table_spec(output), open=True).result()
    writer = TableWriter(table, output, chunk_rows, total)
    embed = embed_fn(model, mesh, meta["dtype"])
    progress = _Progress(total, total - sum(min(batch_rows, total - s) for s in todo), log_every_s)
    if todo:  # compile before the clock starts, so rows/s and the ETA are the steady rate
        jax.block_until_ready(embed(*batch_inputs(vocab, todo[0], batch_rows, mesh)))
    start_time, computed, in_flight = time.time(), 0, None
    window = DispatchWindow(mesh)
    for start in todo:
        result = window.add(embed(*batch_inputs(vocab, start, batch_rows, mesh)))  # dispatched; runs while we write
        if in_flight is not None:
            writer.write(*in_flight, done)
            progress.add(min(batch_rows, total - in_flight[0]))
        in_flight = (start, result)
        computed += min(batch_rows, total - start)
    if in_flight is not None:
        writer.write(*in_flight, done)
        progress.add(min(batch_rows, total - in_flight[0]))
    writer.flush()
    seconds = time.time() - start_time
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
    chunk_rows = flags.DEFINE_integer("chunk_rows", 1024, "Table rows per stored chunk (the unit of resume).")
    batch_rows = flags.DEFINE_integer("batch_rows", 8192, "F-grams per device batch (rounded to whole chunks).")
    join = job_flags.define()
    flags.adopt_module_key_flags(job_flags)  # listed by --help
    return types.SimpleNamespace(workdir=workdir, output=output, dtype=dtype, chunk_rows=chunk_rows,
                                 batch_rows=batch_rows, join=join)


def run(args):
    logs.quiet_libraries()
    tool_main.require(workdir=args.workdir.value, output=args.output.value)
    distributed.initialize(args.join.spec())
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
