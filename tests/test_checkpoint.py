"""Checkpoints restore onto another mesh shape / device count or block layout and refuse mismatched runs."""
import jax
import numpy as np
import pytest
from flax import nnx

from scone_jax import sharding
from scone_jax.runtime import checksums
from scone_jax.training import checkpoint, state as state_lib
from tests.common import small_config


def make_state(mesh_shape, devices):
    config = small_config()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
    mesh = sharding.make_mesh(config.mesh, devices)
    spec = state_lib.state_spec(config, mesh)
    return spec, state_lib.init_state(config, spec)


@pytest.mark.slow  # 10-13 s: the fast tier stays under 5 minutes
def test_checkpoint_saved_on_8_devices_restores_on_4(tmp_path):
    _, saved = make_state((2, 2, 2), jax.devices())
    ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=True)
    ckpt.save(7, saved, {"tokenizer_fingerprint": "abc", "step": 7})
    ckpt.wait()

    spec4, _ = make_state((1, 2, 2), jax.devices()[:4])
    restored, meta = ckpt.restore(7, state_lib.abstract_with_shardings(spec4), expect={"tokenizer_fingerprint": "abc"})
    assert meta["step"] == 7
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        assert a.sharding.mesh.devices.size == 4
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


def test_mismatched_fingerprint_is_refused(tmp_path):
    spec, saved = make_state((8, 1, 1), jax.devices())
    ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, saved, {"tokenizer_fingerprint": "abc"})
    with pytest.raises(checkpoint.CheckpointMismatchError, match="tokenizer_fingerprint='abc'"):
        ckpt.restore(1, state_lib.abstract_with_shardings(spec), expect={"tokenizer_fingerprint": "xyz"})
    assert ckpt.latest_step() == 1
    ckpt.close()


def test_relative_directory_works(tmp_path, monkeypatch):
    spec, saved = make_state((8, 1, 1), jax.devices())
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint.Checkpointer("workdirs/run/checkpoints", async_save=True)
    ckpt.save(2, saved, {"step": 2})
    ckpt.wait()
    restored, _ = ckpt.restore(2, state_lib.abstract_with_shardings(spec))
    assert (tmp_path / "workdirs/run/checkpoints/2").is_dir()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


def layout_state(scan_layers: bool, seed: int = 0):
    config = small_config()
    config.model.scan_layers = scan_layers
    config.train.seed = seed
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    return config, mesh, spec, state_lib.init_state(config, spec)


@pytest.mark.parametrize("saved_scanned", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_checkpoint_of_the_other_block_layout_is_converted_on_restore(tmp_path, saved_scanned):
    """Checkpoints from before scanned layers (and unscanned debugging runs) resume in a scanned
    run and vice versa: every parameter and Adam moment lands in its layer. Catches a
    conversion that stacks the layers in reverse order (seen to fail) or leaves the optimizer's
    moments behind."""
    config, _, _, saved = layout_state(saved_scanned)
    config.model.scan_layers = saved_scanned
    ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(5, saved, {"config": config.to_dict(), "step": 5})
    run_config, mesh, spec, _ = layout_state(not saved_scanned, seed=1)
    restored, meta = state_lib.restore(ckpt, 5, run_config, spec, mesh)
    ckpt.close()
    assert meta["step"] == 5
    saved_flat = dict(nnx.to_flat_state(saved))
    restored_flat = nnx.to_flat_state(restored)
    size = lambda flat: sum(v.get_value().size for _, v in flat)  # noqa: E731
    assert size(restored_flat) == size(saved_flat.items())
    assert sum("mu" in p for p, _ in restored_flat) > 10 and sum("nu" in p for p, _ in restored_flat) > 10
    for path, variable in restored_flat:
        value = variable.get_value()
        at = next((i + 1 for i, key in enumerate(path[:-1]) if key == "blocks"), None)
        if at is None:
            np.testing.assert_array_equal(value, saved_flat[path].get_value())
        elif saved_scanned:  # restored unscanned: (.., blocks, i, ..) is layer i of the stack
            stacked = saved_flat[path[:at] + path[at + 1:]].get_value()
            np.testing.assert_array_equal(value, stacked[path[at]])
        else:  # restored scanned: layer i of the stack is (.., blocks, i, ..)
            for i in range(value.shape[0]):
                np.testing.assert_array_equal(value[i], saved_flat[path[:at] + (i,) + path[at:]].get_value())


def test_a_checkpoint_of_another_model_shape_is_refused_in_one_line(tmp_path):
    """Restoring onto a model with other array shapes used to fail deep inside orbax; now it is
    a CheckpointMismatchError naming the first array that differs and both shapes."""
    spec, saved = make_state((8, 1, 1), jax.devices())
    ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, saved, {"step": 1})
    wider = small_config(d_ff=256)
    other = state_lib.state_spec(wider, sharding.make_mesh(wider.mesh))
    with pytest.raises(checkpoint.CheckpointMismatchError,
                       match=r"^Checkpoint .*/1 does not fit the model this config builds: "
                             r"0/stack/blocks/mlp/down/kernel/value is \(2, 128, 64\) there and \(2, 256, 64\) here\."):
        ckpt.restore(1, state_lib.abstract_with_shardings(other))
    ckpt.close()


def test_switching_the_fgram_model_delay_on_at_resume_is_refused_naming_the_key(tmp_path):
    """train.fgram_model_delay_steps > 0 adds a counter to the optimizer state: a run saved without it
    is refused in one line naming the key; another positive delay restores."""
    def spec_and_state(delay):
        config = small_config()
        config.train.fgram_model_delay_steps = delay
        spec = state_lib.state_spec(config, sharding.make_mesh(config.mesh))
        return spec, state_lib.init_state(config, spec)

    _, plain = spec_and_state(0)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "plain"), async_save=False)
    ckpt.save(1, plain, {"step": 1})
    delayed_spec, delayed = spec_and_state(40)
    with pytest.raises(checkpoint.CheckpointMismatchError,
                       match=r"^Checkpoint .*/1 does not fit the optimizer this config builds: 1/.*count.* is absent "
                             r"there and \(\) here\. Fix: .*train\.fgram_model_delay_steps"):
        ckpt.restore(1, state_lib.abstract_with_shardings(delayed_spec))
    ckpt.close()

    ckpt = checkpoint.Checkpointer(str(tmp_path / "delayed"), async_save=False)
    ckpt.save(1, delayed, {"step": 1})
    other_spec, _ = spec_and_state(80)
    restored, _ = ckpt.restore(1, state_lib.abstract_with_shardings(other_spec))
    assert len(jax.tree.leaves(restored)) == len(jax.tree.leaves(delayed))
    ckpt.close()


def test_state_checksums_cover_every_array_and_see_swaps_and_small_changes(tmp_path):
    """The checksums a checkpoint saves cover every array of the state, change when two rows
    swap places or one element moves by 1e-3, and equal those of the restored state (on any
    mesh: integer sums). Tried: a checksum without position weights (the swap then passes); one that skips
    element 0 of every array (the change to the first element then passes)."""
    spec, saved = make_state((8, 1, 1), jax.devices())
    ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(1, saved, {"step": 1})
    meta = ckpt.read_checkpoint_meta(1)
    path = "[0]['token_embed']['embedding'].value"
    assert set(meta["state_checksums"]) == {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved)}
    embedding = np.asarray(saved[0]["token_embed"]["embedding"][...])
    swapped = embedding.copy()
    swapped[[3, 4]] = embedding[[4, 3]]
    def nudged(i):  # element i (flat) moved by 1e-3
        return embedding + np.where(np.arange(embedding.size) == i, 1e-3, 0).reshape(embedding.shape)

    for changed in (swapped, nudged(0), nudged(7), nudged(embedding.size - 1)):
        tampered = jax.tree.map(lambda x: x, saved)
        tampered[0]["token_embed"]["embedding"][...] = jax.device_put(changed, saved[0]["token_embed"]["embedding"][...].sharding)
        assert checksums.tree_checksums(tampered)[path] != meta["state_checksums"][path]
    restored, _ = ckpt.restore(1, state_lib.abstract_with_shardings(spec))
    assert checksums.tree_checksums(restored) == meta["state_checksums"]
    ckpt.close()
