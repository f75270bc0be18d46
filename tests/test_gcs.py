"""gs:// for real, against a local GCS emulator: export, evaluate and a train-state checkpoint."""

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator (the [test] extra)")

from scone_jax import bundle, evaluate, export, inference, sharding, state as state_lib  # noqa: E402
from scone_jax.table import HostTable  # noqa: E402
from tests import gcs_emulator, serving_run  # noqa: E402
from tests.common import small_config  # noqa: E402


@pytest.fixture(scope="module")
def bucket():
    with gcs_emulator.running() as url:
        yield url


def test_export_to_gcs_evaluates_like_the_local_export(tmp_path_factory, bucket):
    run = serving_run.trained_run(tmp_path_factory)
    text = serving_run.eval_text(tmp_path_factory)
    output = f"{bucket}/exports/run1"
    export.export(run["workdir"], output, dtype="float32", chunk_rows=64, batch_rows=512)
    assert bundle.read_bytes(output, bundle.COMPLETE) is not None
    assert export.export(run["workdir"], output, dtype="float32", chunk_rows=64, batch_rows=512)["rows_computed"] == 0

    local = inference.load(serving_run.exported(tmp_path_factory, "float32"))
    remote = inference.load(output)
    ids = np.arange(2000)
    np.testing.assert_array_equal(remote.table.gather(ids), local.table.gather(ids))
    cached = HostTable.open(output, max_bytes=4 * 64 * 64 * 4)  # rows read on demand from GCS
    np.testing.assert_array_equal(cached.gather(ids[::7]), local.table.gather(ids[::7]))

    overrides = {"data.source": "text", "data.eval_files": text}
    a = evaluate.evaluate(remote, evaluate.data_config(remote, overrides).data)
    b = evaluate.evaluate(local, evaluate.data_config(local, overrides).data)
    assert a["tokens"] == b["tokens"] and a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-6)


def small_model_state():
    """Model parameters of a 1-layer model, no optimizer: few files, since each costs emulator round trips."""
    config = small_config(num_layers=1)
    spec = state_lib.state_spec(config, sharding.make_mesh(config.mesh))
    return state_lib.abstract_with_shardings(spec)[0], state_lib.init_state(config, spec)[0]


def test_model_checkpoint_round_trips_through_gcs(bucket):
    """The layout train.py writes (state + JSON meta per step, via CheckpointManager), on gs://.

    Without OCDBT: with it, tensorstore's manifest reads fail on the emulator now and then
    ('Malformed StorageGeneration'; the emulator ignores generation preconditions). Real GCS is fine."""
    pytest.importorskip("gcsfs", reason="orbax reaches gs:// directories through etils.epath, which needs gcsfs")
    target, saved = small_model_state()
    directory = f"{bucket}/run/checkpoints"
    handlers = {"state": ocp.StandardCheckpointHandler(use_ocdbt=False), "meta": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, item_handlers=handlers) as manager:
        manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(saved),
                                                meta=ocp.args.JsonSave({"step": 5})))
        manager.wait_until_finished()
    with ocp.CheckpointManager(directory, item_handlers=handlers) as manager:
        assert manager.latest_step() == 5
        restored = manager.restore(5, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    assert restored["meta"] == {"step": 5}
    for a, b in zip(jax.tree.leaves(restored["state"]), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
