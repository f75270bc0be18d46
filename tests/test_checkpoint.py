"""Checkpoints restore onto another mesh shape / device count and refuse mismatched runs."""
import jax
import numpy as np
import pytest

from scone_jax import checkpoint, sharding, state as state_lib
from tests.common import small_config


def make_state(mesh_shape, devices):
    config = small_config()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
    mesh = sharding.make_mesh(config.mesh, devices)
    spec = state_lib.state_spec(config, mesh)
    return spec, state_lib.init_state(config, spec)


def test_checkpoint_saved_on_8_devices_restores_on_4(tmp_path):
    _, saved = make_state((2, 2, 2), jax.devices())
    ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=True)
    ckpt.save(7, saved, None, {"tokenizer_fingerprint": "abc", "step": 7})
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
    ckpt.save(1, saved, None, {"tokenizer_fingerprint": "abc"})
    with pytest.raises(checkpoint.CheckpointMismatchError, match="tokenizer_fingerprint='abc'"):
        ckpt.restore(1, state_lib.abstract_with_shardings(spec), expect={"tokenizer_fingerprint": "xyz"})
    assert ckpt.latest_step() == 1
    ckpt.close()


def test_relative_directory_works(tmp_path, monkeypatch):
    spec, saved = make_state((8, 1, 1), jax.devices())
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint.Checkpointer("workdirs/run/checkpoints", async_save=True)
    ckpt.save(2, saved, None, {"step": 2})
    ckpt.wait()
    restored, _ = ckpt.restore(2, state_lib.abstract_with_shardings(spec))
    assert (tmp_path / "workdirs/run/checkpoints/2").is_dir()
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()
