"""A parent whose worker processes are busy for a minute, for tests/test_operator_safety.py to SIGKILL:
`python -m tests.orphan_probe run_pool|extract_pool|grain WORKDIR`. It starts the workers on tasks that
sleep 60 s (each first writes WORKDIR/busy-<pid>) and waits for the first result. `late_start` instead starts one worker that is still starting
up (it calls parent_watch.exit_with_parent after 3 s) when the parent exits: it prints the worker's pid
and exits at once."""
import os
import sys
import time


def _mark_busy():
    """A file per worker that has started its task (the test kills the parent only then, so a loaded machine's
    slow worker start-up does not count against the exit bound)."""
    open(os.path.join(os.environ["ORPHAN_PROBE_DIR"], f"busy-{os.getpid()}"), "w").close()


def busy(_):
    _mark_busy()
    time.sleep(60)
    return 0


def slow_transform(batch):
    _mark_busy()
    time.sleep(60)
    return batch


def _noop(*_):
    pass


def late_worker():
    from scone_jax.runtime import parent_watch

    time.sleep(3)  # the parent is gone by now
    parent_watch.exit_with_parent()
    time.sleep(60)


def main(kind: str, workdir: str) -> None:
    os.environ["ORPHAN_PROBE_DIR"] = workdir  # inherited by the workers
    if kind == "late_start":
        import multiprocessing

        worker = multiprocessing.get_context("spawn").Process(target=late_worker)
        worker.start()
        print(worker.pid, flush=True)
        os._exit(0)
    if kind == "run_pool":
        from scone_jax.data import tokenize

        next(tokenize.run_pool(busy, range(4), 2, _noop, ()))
    elif kind == "extract_pool":
        from scone_jax.fgram import extract

        with extract._mapper(2) as mapper:
            next(iter(mapper(busy, range(4))))
    else:
        from scone_jax.data import corpus, pipeline, tokenizer_training
        from tests.common import small_config

        config = small_config()
        config.data.worker_count, config.data.prefetch_buffer = 2, 4
        tok = tokenizer_training.train_tokenizer(corpus.kjv_documents("train", 0.02)[:200],
                                                 os.path.join(workdir, "tok.model"), 400)
        next(iter(pipeline.make_train_dataset(config.data, tok, batch_transform=slow_transform)))


if __name__ == "__main__":
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags
    main(sys.argv[1], sys.argv[2])
