"""EleutherAI lm-evaluation-harness on an export: `python -m scone_jax.serving.lm_eval --export=DIR --tasks=a,b`.

Install the harness with `pip install -e '.[harness]'` (lm_eval's core; no torch). The adapter,
SconeHarnessLM, serves the harness's three request types from an export loaded as
scone_jax/serving/inference.py loads it: the decoder on the devices, the f-gram rows gathered from the
table (in host RAM or read from disk: --table) for the longest match at each position (docs/method.md §2 and §7), never the f-gram
model:
  loglikelihood          log P(continuation | [bos] + context), batched in padded buckets of lengths;
                         contexts longer than data.seq_len lose their oldest tokens. A run trained
                         without bos (data.add_bos=False, read from the export) reads the context
                         alone, and an empty one as [eos] (data/prompt.py).
  loglikelihood_rolling  a document's log-likelihood in the windows scone_jax.serving.evaluate cuts
                         from a held-out set of that one document ([bos] + ids or ids, as the run packed
                         its documents (data/packing.py), back-to-back windows of
                         data.seq_len, each matched and scored on its own; the last one gets no extra
                         context, unlike the harness's usual rolling windows), so the total is the one
                         evaluate reports; by default it counts the end-of-document prediction as
                         evaluate does (--norolling_eos: the text's tokens only).
  generate_until         the KV-cache Generator (serving/generate.py), greedy unless do_sample; the
                         text is cut at the first `until` string and at end of document.

Offline by default: HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 are set before `datasets` loads, so
tasks read only local files (a task YAML with `dataset_path: json` and
`dataset_kwargs: {data_files: ...}` under --include_path) or datasets already in the Hugging Face
cache. --allow_downloads lets the harness fetch datasets from the Hub.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
import types
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from flax import nnx

from scone_jax import sharding
from scone_jax.batch import Batch
from scone_jax.data import packing, prompt
from scone_jax.model import scone
from scone_jax.runtime import logs, tool_main
from scone_jax.runtime.errors import one_line
from scone_jax.runtime.prefetch import DispatchWindow, Prefetcher
from scone_jax.serving import generate, inference

try:  # absolute import: the top-level harness package, not this module
    from lm_eval.api.model import TemplateLM
    _HARNESS_MISSING = None
except ImportError as e:  # the class below still defines, so `--help` and the error below work without it
    TemplateLM, _HARNESS_MISSING = object, e

PROGRAM = "scone_jax.serving.lm_eval"
OFFLINE_VARIABLES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
DEFAULT_MAX_GEN_TOKS = 256  # the harness's default when a task sets no max_gen_toks
_MIN_BUCKET = 16


def require_harness() -> None:
    """ValueError with the fix when the lm_eval package is not installed (the CLI prints it in one line)."""
    if _HARNESS_MISSING is not None:
        raise ValueError(f"the lm_eval package cannot be imported ({_HARNESS_MISSING}). "
                         "Fix: pip install -e '.[harness]' (lm_eval==0.4.13).")


def go_offline() -> None:
    """Keep the harness off the network: the variables `datasets` and `huggingface_hub` read at import,
    and their module constants too if something imported them already."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
    if "huggingface_hub.constants" in sys.modules:
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True
    if "datasets.config" in sys.modules:
        config = sys.modules["datasets.config"]
        config.HF_HUB_OFFLINE = config.HF_DATASETS_OFFLINE = True


def bucket_length(n: int, max_length: int) -> int:
    """The padded length of a row of n positions: a power of two (at least 16), at most max_length, so
    the scoring step compiles once per bucket rather than once per length."""
    return min(max_length, max(_MIN_BUCKET, 1 << max(n - 1, 0).bit_length()))


def document_windows(ids: Sequence[int], bos: int | None, eos: int, window: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) of one document as evaluation packs it (data/packing.examples): inputs [bos] + ids,
    targets ids + [eos] (bos None: inputs ids, targets ids[1:] + [eos]), cut into back-to-back windows of
    `window` positions; each window is a fresh row (positions from 0, no match reaching back into the
    previous window)."""
    ids = np.asarray(ids, np.int32)
    inputs, targets, _ = packing.examples(ids, np.array([len(ids)]), bos, eos)
    return [(inputs[s:s + window], targets[s:s + window]) for s in range(0, len(inputs), window)]


def make_score_step(served: inference.Served):
    """jit(batch) -> (log P(target) [B, T], target is the argmax [B, T]) with the table's rows, sharded by rows.

    The log-probabilities are minus the token losses (model/scone.py), the quantity evaluate sums."""
    graphdef = served.graphdef

    @jax.jit
    def step(params, batch):
        decoder = nnx.merge(graphdef, params)
        logits = scone.batch_logits(decoder, batch)
        greedy = jnp.argmax(logits, axis=-1) == batch.targets
        return -scone.cross_entropy(logits, batch), greedy

    run = sharding.under_mesh(served.mesh, step)
    return lambda batch: run(served.params, batch)


class SconeHarnessLM(TemplateLM):
    """An lm_eval language model backed by an export (inference.Served); see the module docstring.

    batch_size: rows per device step (0: the run's data.global_batch_size), rounded up to a multiple of
    the mesh's batch shards. max_length: the longest row scored or generated (0: the run's
    data.seq_len, the length it was trained and is evaluated at). rolling_eos: loglikelihood_rolling
    counts the end-of-document prediction, as scone_jax.serving.evaluate does.
    """

    def __init__(self, served: inference.Served, *, batch_size: int = 0, max_length: int = 0,
                 rolling_eos: bool = True, seed: int = 0):
        require_harness()
        super().__init__()
        if jax.process_count() > 1:
            raise ValueError(f"{PROGRAM} runs on one host; this job has {jax.process_count()} JAX processes.")
        model = served.config.model
        self.served = served
        self.add_bos = served.config.data.add_bos  # how the run's documents started (data/prompt.py)
        self.max_length = max_length or served.config.data.seq_len
        if model.position == "learned" and self.max_length > model.max_seq_len:
            raise ValueError(f"max_length={self.max_length} exceeds model.max_seq_len={model.max_seq_len}, the "
                             "longest sequence the model has positions for.")
        shards = sharding.num_batch_shards(served.mesh)
        rows = batch_size or served.config.data.global_batch_size
        self.batch_size = -(-rows // shards) * shards
        self.rolling_eos = rolling_eos
        self.seed = seed
        self._score_step = make_score_step(served)
        self._generators: dict[tuple[float, int], generate.Generator] = {}
        self._calls = 0

    # --- tokens -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.served.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """Every training document starts with bos, so an empty context is [bos], not eos (without bos: eos,
        data/prompt.start_id)."""
        return prompt.start_id(self.served.tokenizer, self.add_bos)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The export's tokenizer; a context as the run's documents start (data/prompt.prompt_ids: [bos] first
        unless the run had none) unless add_special_tokens is False (the harness passes False for a
        continuation it scores after prefix_token_id)."""
        if add_special_tokens is False:
            return [int(i) for i in self.served.tokenizer.encode(string)]
        return prompt.prompt_ids(self.served.tokenizer, string, self.add_bos).tolist()

    def tok_decode(self, ids) -> str:
        return self.served.tokenizer.decode(ids)

    def get_model_info(self) -> dict:
        meta = self.served.bundle.meta
        return {"scone_export": {k: meta.get(k) for k in ("model_fingerprint", "tokenizer_fingerprint",
                                                            "fgram_vocab_fingerprint", "d_model")},
                "max_length": self.max_length, "rolling_eos": self.rolling_eos}

    # --- scoring ------------------------------------------------------------------------------------
    def score_rows(self, rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(log P(target), target is the argmax) per position of each (inputs, targets) row, one document
        piece per row starting at position 0. Rows are sorted by length, packed batch_size at a time into
        right-padded buckets, and their f-gram rows gathered on a background thread while the device
        runs the previous batch."""
        pad = self.served.tokenizer.pad_id
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for i in order:
            if not 0 < len(rows[i][0]) <= self.max_length or len(rows[i][0]) != len(rows[i][1]):
                raise ValueError(f"a row of {len(rows[i][0])} inputs and {len(rows[i][1])} targets does not fit "
                                 f"max_length={self.max_length}")
        chunks = [order[s:s + self.batch_size] for s in range(0, len(order), self.batch_size)]

        def prepare(chunk):
            width = bucket_length(len(rows[chunk[0]][0]), self.max_length)
            inputs = np.full((self.batch_size, width), pad, np.int32)
            targets = np.full((self.batch_size, width), pad, np.int32)
            segment_ids = np.zeros((self.batch_size, width), np.int32)
            for r, i in enumerate(chunk):
                inputs[r, :len(rows[i][0])] = rows[i][0]
                targets[r, :len(rows[i][1])] = rows[i][1]
                segment_ids[r, :len(rows[i][0])] = 1
            real = segment_ids > 0
            batch = Batch(inputs=inputs, targets=targets, segment_ids=segment_ids,
                          positions=np.where(real, np.arange(width, dtype=np.int32), 0).astype(np.int32),
                          loss_mask=real.astype(np.float32))
            return chunk, inference.device_batch(self.served, inference.host_rows(self.served, batch))

        out: list = [None] * len(rows)

        def collect(chunk, result):
            logp, greedy = (np.asarray(a) for a in jax.device_get(result))
            for r, i in enumerate(chunk):
                n = len(rows[i][0])
                out[i] = (logp[r, :n].astype(np.float64), greedy[r, :n])

        prefetch = Prefetcher(chunks, prepare)
        window = DispatchWindow(self.served.mesh)
        pending = None
        try:
            for chunk, batch in prefetch:
                result = window.add(self._score_step(batch))  # dispatched; the previous batch's result is read meanwhile
                if pending is not None:
                    collect(*pending)
                pending = (chunk, result)
            if pending is not None:
                collect(*pending)
        finally:
            prefetch.close()
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding would produce it) per
        ((context, continuation), context_ids, continuation_ids). An empty context means [bos]."""
        rows, spans = [], []
        for _, context, continuation in requests:
            context, continuation = list(context) or [self.prefix_token_id], list(continuation)
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored within "
                                 f"max_length={self.max_length} positions")
            whole = np.asarray(context + continuation, np.int32)
            inputs, targets = whole[:-1][-self.max_length:], whole[1:][-self.max_length:]  # oldest context goes
            rows.append((inputs, targets))
            spans.append(len(continuation))
        scored = self.score_rows([r for r, n in zip(rows, spans) if n])
        results, it = [], iter(scored)
        for (key, _, _), n in zip(requests, spans):
            if n == 0:
                result = (0.0, True)
            else:
                logp, greedy = next(it)
                result = (float(logp[-n:].sum()), bool(greedy[-n:].all()))
            results.append(result)
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood in evaluate's windows (document_windows); see the module docstring."""
        tok = self.served.tokenizer
        rows, owner = [], []
        for d, request in enumerate(requests):
            bos = prompt.document_bos(tok, self.add_bos)
            for window in document_windows(tok.encode(request.args[0]), bos, tok.eos_id, self.max_length):
                rows.append(window)
                owner.append(d)
        totals = np.zeros(len(requests), np.float64)
        last = {}
        for d, (logp, _) in zip(owner, self.score_rows(rows)):
            totals[d] += logp.sum()
            last[d] = logp[-1]  # the end-of-document prediction ends the document's last window
        results = []
        for d, request in enumerate(requests):
            total = float(totals[d] if self.rolling_eos else totals[d] - last[d])
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return results

    # --- generation ---------------------------------------------------------------------------------
    def _generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int, float, int, float]:
        """(until, max_gen_toks, temperature, top_k, top_p) from a request's kwargs; ValueError for what the
        Generator cannot do (it samples with temperature, top_k and top_p only)."""
        from lm_eval.models.utils import normalize_gen_kwargs

        kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs or {}), DEFAULT_MAX_GEN_TOKS))
        until = [s for s in kwargs.pop("until") if isinstance(s, str) and s]
        max_gen_toks = int(kwargs.pop("max_gen_toks"))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        top_k = int(kwargs.pop("top_k", 0) or 0)
        top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
        neutral = {"num_beams": 1, "num_return_sequences": 1}
        unsupported = sorted(k for k, v in kwargs.items() if neutral.get(k, object()) != v and v is not None)
        if unsupported:
            raise ValueError(f"generate_until asks for {', '.join(f'{k}={kwargs[k]!r}' for k in unsupported)}, "
                             "which the SCONE Generator cannot serve (it decodes greedily or samples with "
                             "temperature, top_k and top_p). Fix: drop those generation_kwargs from the task or "
                             "choose a task without them.")
        return until, max_gen_toks, (temperature if do_sample else 0.0), top_k, top_p

    def generator(self, temperature: float, top_k: int, top_p: float = 1.0) -> generate.Generator:
        key = (temperature, top_k, top_p)
        if key not in self._generators:
            self._generators[key] = generate.Generator(self.served, temperature=temperature, top_k=top_k, top_p=top_p)
        return self._generators[key]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context with the KV-cache Generator: [bos] + context (tok_encode; oldest tokens dropped so that
        context + new tokens fit max_length), at most max_gen_toks new tokens, cut at end of document and
        before the first `until` string. Requests with the same settings and prompt length decode together."""
        jobs = {}
        for r, request in enumerate(requests):
            if len(request.args) != 2 or not isinstance(request.args[0], str):
                raise ValueError(f"generate_until got a request with arguments of types "
                                 f"{[type(a).__name__ for a in request.args]}; the SCONE adapter serves text "
                                 "contexts only (no images or chat messages). Fix: choose a text-only task.")
            context, gen_kwargs = request.args
            until, max_gen_toks, temperature, top_k, top_p = self._generation_settings(gen_kwargs)
            new = min(max_gen_toks, self.max_length - 1)
            prompt = self.tok_encode(context)[-(self.max_length - new):]
            jobs.setdefault((temperature, top_k, top_p, len(prompt), new), []).append((r, prompt, until))
        results: list[str | None] = [None] * len(requests)
        for (temperature, top_k, top_p, _, new), group in jobs.items():
            for start in range(0, len(group), self.batch_size):
                part = group[start:start + self.batch_size]
                if new <= 0:
                    texts = [""] * len(part)
                else:
                    rows = max(len(part), min(1 << (len(part) - 1).bit_length(), self.batch_size))  # few shapes
                    prompts = np.asarray([p for _, p, _ in part] + [part[-1][1]] * (rows - len(part)), np.int32)
                    self._calls += 1
                    out = self.generator(temperature, top_k, top_p).generate(prompts, new, seed=self.seed + self._calls)
                    texts = [self._finish(row[prompts.shape[1]:], until)
                             for row, (_, _, until) in zip(out["tokens"], part)]
                for (r, _, _), text in zip(part, texts):
                    results[r] = text
                    self.cache_hook.add_partial("generate_until", requests[r].args, text)
        return results

    def _finish(self, new_ids: np.ndarray, until: list[str]) -> str:
        """Text of the new tokens up to end of document, then up to the first stop string."""
        new_ids = [int(i) for i in new_ids]
        if self.eot_token_id in new_ids:
            new_ids = new_ids[:new_ids.index(self.eot_token_id)]
        text = self.tok_decode(new_ids)
        for stop in until:
            text = text.split(stop)[0]
        return text


# --- the program --------------------------------------------------------------------------------------
def task_manager(names: list[str], include_path: list[str]):
    """The harness's task index. With --include_path, only those directories are scanned first (the
    built-in index takes seconds to build) and the built-in tasks are added only when a name is not there."""
    from lm_eval.tasks import TaskManager

    if include_path:
        missing = [p for p in include_path if not os.path.isdir(p)]
        if missing:
            raise ValueError(f"--include_path {missing} is no directory. Fix: pass directories of task YAMLs.")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(local.match_tasks([n]) or n.endswith(".yaml") for n in names):
            return local
    return TaskManager(include_path=include_path or None)


def _missing_local_file(e: OSError) -> str | None:
    """The local path a datasets FileNotFoundError names, if it names a path (not a Hub dataset id)."""
    match = re.search(r"Unable to find '([^']+)'", str(e))
    if isinstance(e, FileNotFoundError) and match and (os.path.isabs(match.group(1)) or
                                                       os.path.splitext(match.group(1))[1]):
        return match.group(1)
    return None


def load_tasks(manager, names: list[str], offline: bool) -> list:
    """The Task and Group objects the names stand for (globs expanded), their data loaded now, before the
    export: an unknown name or data that cannot be had fails in one line with its fix."""
    unknown = [n for n in names if not manager.match_tasks([n]) and not (n.endswith(".yaml") and os.path.isfile(n))]
    if unknown:
        hints = {n: difflib.get_close_matches(n, manager.all_tasks, n=3) for n in unknown}
        close = "; ".join(f"{n!r}: did you mean {', '.join(h)}?" for n, h in hints.items() if h)
        raise ValueError(
            f"unknown task(s) {', '.join(map(repr, unknown))}{' (' + close + ')' if close else ''}. Fix: list the "
            "tasks with `lm-eval ls tasks` (add `--include_path DIR` for your own), or pass --include_path=DIR "
            "with the directory of the task's YAML.")
    objects = []
    for name in names:
        for task in (manager.match_tasks([name]) or [name]):
            try:
                loaded = manager.load([task])
            except OSError as e:  # datasets: ConnectionError offline, FileNotFoundError for missing files
                local = _missing_local_file(e)
                if local:
                    raise ValueError(f"task {task!r}: its data file {local} does not exist. Fix: correct the path in "
                                     "the task's data_files (or create the file).") from e
                fix = ("pass --allow_downloads to fetch it from the Hugging Face Hub, or point the task at local "
                       "files (dataset_path: json, dataset_kwargs: {data_files: ...}) in a YAML under --include_path"
                       if offline else "check the task's dataset_path and data_files")
                raise ValueError(f"task {task!r}: its data is not available{' offline' if offline else ''} "
                                 f"({type(e).__name__}: {e}). Fix: {fix}.") from e
            except Exception as e:  # noqa: BLE001 - datasets failing on the file itself (empty: StopIteration)
                why = one_line(e) if str(e) else "no records could be read"
                raise ValueError(f"task {task!r}: its data cannot be loaded ({type(e).__name__}: {why}; an empty or "
                                 "malformed data file?). Fix: check the files the task's data_files name.") from e
            group = loaded["groups"].get(task)
            objects.extend([group] if group is not None else loaded["tasks"].values())
    return objects


def _define_flags():
    """Command-line flags, defined only when this module runs as a program (modules share absl's registry)."""
    export = inference.define_export_flag()
    tasks = flags.DEFINE_list("tasks", [], "Harness task, group or tag names (globs allowed), comma-separated.")
    include_path = flags.DEFINE_list("include_path", [], "Directories of your own task YAMLs, comma-separated.")
    num_fewshot = flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per prompt (default: the task's).")
    limit = flags.DEFINE_float("limit", None, "Documents per task: a count, or a fraction if < 1 (for quick runs).")
    batch_size = flags.DEFINE_integer("batch_size", 0, "Rows per device step; 0 = the run's data.global_batch_size.")
    max_length = flags.DEFINE_integer("max_length", 0, "Longest row scored or generated; 0 = the run's data.seq_len.")
    rolling_eos = flags.DEFINE_bool("rolling_eos", True, "Perplexity tasks count the end-of-document prediction, "
                                    "as scone_jax.serving.evaluate does; --norolling_eos: the text's tokens only.")
    output = flags.DEFINE_string("output", "", "Where to write the results as JSON ('' = nowhere).")
    allow_downloads = flags.DEFINE_bool(
        "allow_downloads", False, "Let the harness download datasets from the Hugging Face Hub. Without it "
        "HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 are set: only local files and the datasets cache are read.")
    bootstrap_iters = flags.DEFINE_integer("bootstrap_iters", 100000, "Bootstrap resamples for standard errors "
                                           "(0 = none).")
    table, max_table_bytes = inference.define_table_flags()
    seed = flags.DEFINE_integer("seed", 0, "Seed of sampled generation and of the harness's few-shot draws.")
    return types.SimpleNamespace(
        export=export, tasks=tasks, include_path=include_path, num_fewshot=num_fewshot, limit=limit,
        batch_size=batch_size, max_length=max_length, rolling_eos=rolling_eos, output=output,
        allow_downloads=allow_downloads, bootstrap_iters=bootstrap_iters, table=table, max_table_bytes=max_table_bytes,
        seed=seed)


def run(args):
    logs.quiet_libraries()
    path = args.export.value
    tool_main.require(export=path, tasks=args.tasks.value)
    if args.output.value:
        tool_main.check_result_path(args.output.value, "--output")
    offline = not args.allow_downloads.value
    if offline:
        go_offline()  # before the harness imports datasets
    require_harness()
    from lm_eval import evaluator, utils

    manager = task_manager(args.tasks.value, args.include_path.value)
    tasks = load_tasks(manager, args.tasks.value, offline)
    limit = args.limit.value
    if limit is not None and limit >= 1:
        limit = int(limit)
    served = inference.load(path, table=args.table.value, max_table_bytes=args.max_table_bytes.value)
    lm = SconeHarnessLM(served, batch_size=args.batch_size.value, max_length=args.max_length.value,
                        rolling_eos=args.rolling_eos.value, seed=args.seed.value)
    logging.info("%s: %d task(s), %d rows per step, max_length %d", PROGRAM, len(tasks), lm.batch_size,
                 lm.max_length)
    results = evaluator.simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot.value, limit=limit,
        batch_size=lm.batch_size, bootstrap_iters=args.bootstrap_iters.value, log_samples=False,
        random_seed=args.seed.value, numpy_random_seed=args.seed.value, fewshot_random_seed=args.seed.value)
    results["config"]["model"] = f"scone_jax export {path}"
    print(utils.make_table(results))
    if results.get("groups"):
        print(utils.make_table(results, "groups"))
    if args.output.value:
        tool_main.write_result(args.output.value, results, default=utils.handle_non_serializable, ensure_ascii=False)


if __name__ == "__main__":
    _args = _define_flags()
    tool_main.run(lambda: run(_args), program=PROGRAM)
