"""SCONE trains the same in every mode: gradient accumulation and mesh shapes against one
device and one big batch, on production batches (FgramBatcher's layout for each mode)."""
import jax
import numpy as np
import pytest
from flax import nnx

from scone_jax import config as config_lib, sharding
from scone_jax.training import state as state_lib, steps
from tests.common import assert_sums_close, largest, small_config
from tests.scone_batches import K, ROWS, SEQ, production_batch

CAPACITY = 96  # f-gram rows per data shard and step; splits into 1, 2 or 4 micro-batches
NUM_STEPS = 3


def scone_config(mesh_shape=(1, 1, 1), accum=1):
    config = small_config(num_layers=1)  # one block: what is compared is independent of depth
    config.scone.update(dict(enabled=True, max_len=K, fgram_capacity=CAPACITY, num_layers=1))
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
    config.train.grad_accum_steps = accum
    return config


def setup(mesh_shape, accum):
    config = scone_config(mesh_shape, accum)
    mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[: int(np.prod(mesh_shape))])
    num_shards = sharding.num_batch_shards(mesh)
    config_lib.validate_batch_split(config, num_shards)
    spec = state_lib.state_spec(config, mesh)
    return config, mesh, num_shards, spec, state_lib.init_state(config, spec)


def batch_for(mesh, num_shards, accum, seed):
    host, _ = production_batch(num_shards, CAPACITY, micro_batches=accum, seed=seed)
    return sharding.global_batch(host.for_device(), mesh)


def gradients(mesh_shape, accum, seed=0):
    """steps.loss_and_grads (the train step's core) on the batch laid out for this mode."""
    _, mesh, num_shards, spec, state = setup(mesh_shape, accum)

    @jax.jit
    def run(state, batch):
        model, _ = nnx.merge(spec.graphdef, state)
        return steps.loss_and_grads(model, batch, accum, num_shards)

    with jax.set_mesh(mesh):
        loss, count, grads = run(state, batch_for(mesh, num_shards, accum, seed))
    return float(loss), float(count), jax.device_get(nnx.to_flat_state(grads))


@pytest.fixture(scope="module")
def big_batch_gradients():
    return gradients((1, 1, 1), 1)


@pytest.mark.parametrize("mesh_shape,accum", [pytest.param((1, 1, 1), 4, marks=pytest.mark.slow), ((4, 1, 1), 2)])
def test_accumulated_gradients_equal_one_big_batch(big_batch_gradients, mesh_shape, accum):
    """Loss, token count and every gradient of `accum` micro-batches equal one big batch (fp32).
    Catches micro-batches that take rows i, i+accum, ... while the batcher groups contiguous
    blocks (the slots then point into another micro-batch's f-grams), and splitting f-gram
    rows as if they were batch rows (the bug this test was written for): both seen to fail."""
    want_loss, want_count, want = big_batch_gradients
    loss, count, got = gradients(mesh_shape, accum)
    assert count == want_count
    np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
    assert len(got) == len(want)
    for (path, g), (p2, w) in zip(got, want):
        assert path == p2
        assert_sums_close(g.get_value(), w.get_value(), ROWS * SEQ, largest([v.get_value() for _, v in want]),
                          err_msg=str(path))


def train(mesh_shape, accum):
    """NUM_STEPS train steps: (losses, grad norms, model parameters)."""
    config, mesh, num_shards, spec, state = setup(mesh_shape, accum)
    step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    losses, norms = [], []
    for seed in range(NUM_STEPS):
        state, metrics = step(state, batch_for(mesh, num_shards, accum, seed))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return losses, norms, jax.device_get(jax.tree.leaves(state[0]))


@pytest.fixture(scope="module")
def single_device():
    return train((1, 1, 1), 1)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,accum", [((2, 2, 1), 2), ((1, 2, 2), 1), ((2, 1, 1), 4)])
def test_training_on_a_mesh_with_accumulation_equals_one_device(single_device, mesh_shape, accum):
    """Per-step losses, gradient norms and the parameters after NUM_STEPS steps equal a
    single-device run without accumulation. Catches f-gram rows of one data shard gathered
    on another (shards' groups swapped) and an accumulation split that ignores groups."""
    want_losses, want_norms, want_params = single_device
    losses, norms, params = train(mesh_shape, accum)
    assert want_losses[-1] < want_losses[0]  # it trains
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
    # Adam divides by the gradient's root mean square, so a parameter whose gradient is ~0 can
    # move by ~lr in any direction from last-bit differences; 1e-5 is far below lr = 3e-3.
    for got, want in zip(params, want_params):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    (dict(accum=3), "train.grad_accum_steps=3 does not divide the 16 rows per data shard .* Values that work: "
                    "1, 2, 4, 8, 16"),
    (dict(mesh_shape=(8, 1, 1), accum=4), "does not divide the 2 rows per data shard .* Values that work: 1, 2\\.$"),
])
def test_accumulation_that_does_not_split_the_shard_is_a_config_error(overrides, message):
    config = scone_config(**overrides)
    with pytest.raises(ValueError, match=message):
        config_lib.validate_batch_split(config, int(np.prod(config.mesh.data)))


def test_capacity_that_does_not_split_into_micro_batches_is_a_config_error():
    config = scone_config(accum=4)
    config.scone.fgram_capacity = 90
    with pytest.raises(ValueError, match=r"scone.fgram_capacity=90 .* does not split into train.grad_accum_steps=4 "
                                         r"equal micro-batches. Fix: use a multiple of 4, e.g. 88 or 92."):
        config_lib.validate_batch_split(config, 1)
    config.train.grad_accum_steps = 0
    with pytest.raises(ValueError, match=r"train.grad_accum_steps=0 is not valid: it must be >= 1 \(1 = no accumulation\)"):
        config_lib.validate(config)
