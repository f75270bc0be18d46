"""The optimizer's settings for the f-gram model, step by step through the production train step
(training/steps.py, training/optimizer.py): the delay's ramp as docs/training.md states it, its cap at full,
scone.learning_rate_multiplier, the delay scaled with the f-gram model's depth, and train.grad_clip_norm=0;
and the config's refusals of these settings where they mean nothing.

The ramp is read off the parameters: with b1 = b2 = 0, no weight decay and a constant rate, AdamW's update of
an element is lr * g / (|g| + eps), so the largest move of any f-gram-model parameter in a step is lr times
the factor on its updates (to ~1e-8), and of any decoder parameter lr."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scone_jax import config as config_lib, sharding
from scone_jax.training import checkpoint, optimizer, run as run_lib, state as state_lib, steps
from tests.common import random_batch, run_main, small_config
from tests.scone_batches import K, production_batch

LR = 1e-2


def scone_config(**train):
    config = small_config(num_layers=1)
    config.scone.update(dict(enabled=True, max_len=K, fgram_capacity=48, num_layers=2))
    config.train.update(dict(b1=0.0, b2=0.0, weight_decay=0.0, grad_clip_norm=0.0, warmup_steps=0, min_lr_ratio=1.0,
                             learning_rate=LR, num_steps=8) | train)
    return config


def set_counts(state, count: int):
    """The state with every step counter of the optimizer (nnx's step, optax's counts) at `count`."""
    def put(path, x):
        key = jax.tree_util.keystr(path)
        return jnp.full_like(x, count) if key.endswith("['count'].value") or key == "[1]['step'].value" else x

    return jax.tree_util.tree_map_with_path(put, state)


def production_training(config):
    """(spec, a fresh state, the production train step, one production batch, params: state -> each parameter in
    float64 by path) for `config` on its mesh."""
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    state = state_lib.init_state(config, spec)
    step = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)
    batch = sharding.global_batch(production_batch(num_shards=sharding.num_batch_shards(mesh), capacity=48)[0]
                                  .for_device(), mesh)

    def params(state):
        return {jax.tree_util.keystr(p): np.asarray(x, np.float64)
                for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(state_lib.model_of(spec.graphdef, state),
                                                                          nnx.Param))}

    return spec, state, step, batch, params


def largest_moves(config, state_steps: int, cap_count: int):
    """Runs the production train step `state_steps` times from a fresh state, then once more with every optimizer
    counter set to `cap_count`; per step, (largest move of an f-gram-model parameter / lr, same for the rest / lr)."""
    spec, state, step, batch, params = production_training(config)

    out = []
    for i in range(state_steps + 1):
        if i == state_steps:
            state = jax.device_put(set_counts(state, cap_count), spec.shardings)
        before = params(state)
        state, metrics = step(state, batch)  # donates the old state: `before` holds copies
        assert float(metrics["learning_rate"]) == pytest.approx(LR, rel=1e-6)  # constant rate
        after = params(state)
        moves = {name: np.abs(after[name] - before[name]).max() / LR for name in before}
        out.append((max(v for n, v in moves.items() if n.startswith("['fgram_model']")),
                    max(v for n, v in moves.items() if not n.startswith("['fgram_model']"))))
    return out


# Steps 1-6 (the factor docs/training.md gives: 0 for steps 1..D, k/D at step D + k, 1 from 2D on), then a step
# long after 2D. Caught: the ramp one step late as it was (optax's count taken for the step: D = 2 gave 0, 0, 0,
# 0.5, 1, 1); the ramp without its cap (jnp.maximum(..., 0) for jnp.clip: 2, 3, ... from step 2D + 1, and 5000
# at the late step); scone.learning_rate_multiplier ignored, or applied to the decoder too; the per-layer delay
# not multiplied by scone.num_layers (D = 1: 0, 2.5, 2.5, ... in the second case). The second case alone (the
# fast tier's) was seen to catch each of these.
@pytest.mark.parametrize("train_keys,multiplier,want", [
    pytest.param(dict(fgram_model_delay_steps=1), 2.5, [0, 2.5, 2.5, 2.5, 2.5, 2.5], marks=pytest.mark.slow),
    (dict(fgram_model_delay_steps_per_layer=1), 2.5, [0, 0, 1.25, 2.5, 2.5, 2.5]),  # D = 1 x 2 f-gram blocks
    pytest.param(dict(fgram_model_delay_steps=3), 1.0, [0, 0, 0, 1 / 3, 2 / 3, 1],  # boundary: full at the last
                 marks=pytest.mark.slow),  # step, 2D = 6
    pytest.param(dict(), 0.5, [0.5] * 6, marks=pytest.mark.slow),  # no delay: the multiplier alone (optax.scale)
    pytest.param(dict(fgram_model_delay_fraction=0.15), 1.0, [0, 0, 0.5, 1, 1, 1],  # D = ceil(0.15 x 8 steps) = 2
                 marks=pytest.mark.slow),
], ids=["D1-lr-x2.5", "D2-per-layer-lr-x2.5", "D3-ends-at-the-last-step", "no-delay-lr-x0.5", "D2-share-of-8"])
def test_the_fgram_models_update_factor_step_by_step(train_keys, multiplier, want):
    config = scone_config(**train_keys)
    config.scone.learning_rate_multiplier = multiplier
    config_lib.validate(config)
    moves = largest_moves(config, len(want), cap_count=10_000)
    fgram, rest = np.array([m[0] for m in moves]), np.array([m[1] for m in moves])
    np.testing.assert_allclose(fgram, want + [multiplier], atol=1e-4)  # long after 2D: exactly the multiplier
    np.testing.assert_allclose(rest, 1.0, atol=1e-4)  # the decoder and T: the rate itself, every step


@pytest.mark.parametrize("fraction,num_steps,want", [
    (0.15, 8, 2), (0.065, 1221, 80), (0.065, 367, 24), (0.1, 10, 1), (0.3, 10, 3), (0.0, 1221, 0), (0.999, 3, 3)])
def test_a_delay_given_as_a_share_of_the_run_is_the_steps_that_make_up_at_least_that_share(fraction, num_steps, want):
    """train.fgram_model_delay_fraction=f holds the f-gram model back for D = ceil(f x train.num_steps) steps
    (docs/training.md): 80 of the 1,221 steps of the study's 10M tokens, 24 of 3M's 367; a share that is a whole
    number of steps is that number (0.3 x 10 is 3.0000000000000004 in floats). Caught: round() (0.15 of 8 gave 1;
    0.065 of 1,221 gave 79), int() (79, 23), ceil without the rounding (0.3 of 10 gave 4), the share of
    train.warmup_steps instead of train.num_steps."""
    config = scone_config(fgram_model_delay_fraction=fraction, num_steps=num_steps, warmup_steps=num_steps // 2)
    config_lib.validate(config)
    assert optimizer.fgram_model_delay(config) == want


def test_grad_clip_norm_0_passes_a_huge_gradient_unchanged():
    """With train.grad_clip_norm=0, AdamW's first moment after one production step is (1 - b1) times the
    gradient itself, whose global norm is over 100 times the default clip (1.0); clipped, it would be that
    gradient over its norm. Caught: clipping kept at the default when 0 (`clip_by_global_norm(grad_clip_norm
    or 1.0)` always added: every moment 138 times too small)."""
    config = small_config(num_layers=1)
    config.train.grad_clip_norm = 0.0
    mesh = sharding.make_mesh(config.mesh)
    spec = state_lib.state_spec(config, mesh)
    state = jax.device_put(jax.tree_util.tree_map_with_path(  # final-norm outputs x100: a gradient norm > 100
        lambda p, x: x * 100 if "['final_norm']['scale']" in jax.tree_util.keystr(p) else x,
        state_lib.init_state(config, spec)), spec.shardings)
    host = random_batch()
    grads = jax.jit(nnx.grad(lambda m: steps.token_losses(m, host).sum() / host.loss_mask.sum()))(
        state_lib.model_of(spec.graphdef, state))
    grads = {jax.tree_util.keystr(p): np.asarray(g, np.float64) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    norm = np.sqrt(sum((g * g).sum() for g in grads.values()))
    new_state, metrics = steps.make_train_step(spec.graphdef, spec.shardings, mesh, config)(
        state, sharding.global_batch(host, mesh))
    assert norm > 100 and float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-4)
    mu = {jax.tree_util.keystr(p).split("['mu']", 1)[1]: np.asarray(x, np.float64)
          for p, x in jax.tree_util.tree_leaves_with_path(new_state[1]) if "['mu']" in jax.tree_util.keystr(p)}
    assert set(mu) == set(grads)
    scale = max(np.abs(g).max() for g in grads.values())  # a gradient that is 0 in exact arithmetic (key bias)
    for name, g in grads.items():  # is fp32 noise summed in another order here: an absolute bound for it
        np.testing.assert_allclose(mu[name], (1 - config.train.b1) * g, rtol=1e-3, atol=1e-6 * scale, err_msg=name)


@pytest.mark.slow  # the fast tier keeps one multiplier case
def test_the_gate_trains_at_its_own_multiple_of_the_fgram_models_rate():
    """scone.gate_learning_rate_multiplier G on top of scone.learning_rate_multiplier M: g moves by lr x M x G a
    step (its gradient is not 0 at g = 0), the rest of the f-gram model by lr x M once g is no longer 0 (at g = 0
    nothing of it reaches the loss, so it does not move at step 1), the decoder by lr. Caught: the gate's scale
    applied to the whole f-gram model (its blocks moved by 10 lr); roles.is_gate matching nothing (g moved by 2
    lr)."""
    config = scone_config()
    config.scone.update(dict(gate=True, learning_rate_multiplier=2.0, gate_learning_rate_multiplier=5.0))
    config_lib.validate(config)
    _, state, step, batch, params = production_training(config)

    moves = []
    for _ in range(2):
        before = params(state)
        state, _ = step(state, batch)
        after = params(state)
        move = {name: np.abs(after[name] - before[name]).max() / LR for name in before}
        gate = [n for n in move if n.startswith("['fgram_model']['gate']")]
        assert len(gate) == 1
        moves.append((move[gate[0]], max(v for n, v in move.items() if n.startswith("['fgram_model']") and n != gate[0]),
                      max(v for n, v in move.items() if not n.startswith("['fgram_model']"))))
    np.testing.assert_allclose(moves, [(10.0, 0.0, 1.0), (10.0, 2.0, 1.0)], atol=1e-4)


# --- the config's refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,message", [
    ("scone.learning_rate_multiplier", 0.0, r"^scone\.learning_rate_multiplier=0\.0 is not valid: it must be > 0 "),
    ("scone.learning_rate_multiplier", -1.0, r"^scone\.learning_rate_multiplier=-1\.0 is not valid: it must be > 0 "),
    ("scone.learning_rate_multiplier", 2.0, r"^scone\.learning_rate_multiplier=2\.0 is set on a run without SCONE "
                                            r"\(scone\.enabled=False\).*Fix: set --config\.scone\.enabled=True, or "
                                            r"leave scone\.learning_rate_multiplier at 1\.0\.$"),
    ("scone.gate", True, r"^scone\.gate=True is set on a run without SCONE .*leave scone\.gate at False\.$"),
    ("scone.own_token_embedding", True, r"^scone\.own_token_embedding=True is set on a run without SCONE "),
    ("scone.combine", "add", r"^scone\.combine='add' is set on a run without SCONE "),
    ("scone.row_scale", "token_rms", r"^scone\.row_scale='token_rms' is set on a run without SCONE "),
    ("scone.output_ramp_steps", 40, r"^scone\.output_ramp_steps=40 is set on a run without SCONE "),
    ("scone.output_ramp_steps", -1, r"^scone\.output_ramp_steps=-1 is not valid: it must be >= 0"),
    ("scone.output_projection_init", "zeros", r"^scone\.output_projection_init='zeros' is set on a run without SCONE"),
    ("scone.gate_learning_rate_multiplier", 5.0, r"^scone\.gate_learning_rate_multiplier=5\.0 is set without "
                                                 r"scone\.gate: there is no gate to train\. Fix: "),
    ("train.fgram_model_delay_steps_per_layer", 10, r"^train\.fgram_model_delay_steps=40 and "
                                                    r"train\.fgram_model_delay_steps_per_layer=10 are set; they are "
                                                    r"ways to give the one delay\. Fix: keep one of them and set the "
                                                    r"others to 0\.$"),
    ("train.fgram_model_delay_fraction", 0.065, r"^train\.fgram_model_delay_steps=40 and "
                                                r"train\.fgram_model_delay_fraction=0\.065 are set; .*Fix: keep one "),
    ("train.fgram_model_delay_fraction", 1.0, r"^train\.fgram_model_delay_fraction=1\.0 is not valid: it must be "
                                              r"in \[0, 1\)"),
])
def test_fgram_settings_that_mean_nothing_are_refused_in_one_line(key, value, message):
    """On a baseline run (scone disabled) the f-gram model's settings are refused, a multiplier of 0 or below
    everywhere, and the two delay keys together. Caught: the baseline check skipped (`if s.enabled:`), the
    multiplier's rule written >= 0."""
    config = small_config()
    section, name = key.split(".")
    config[section][name] = value
    if name.startswith("fgram_model_delay_") and (name, value) != ("fgram_model_delay_fraction", 1.0):
        config.train.fgram_model_delay_steps = 40  # the other delay key set beside it
    with pytest.raises(ValueError, match=message) as e:
        config_lib.validate(config)
    assert "\n" not in str(e.value)
    config.scone.enabled = True  # with SCONE on (and the gate for its multiplier), these are fine
    config.scone.gate = config.scone.gate or name == "gate_learning_rate_multiplier"
    if key in ("scone.gate", "scone.combine", "scone.row_scale") or not isinstance(value, str) and value > 0 and section == "scone":
        config_lib.validate(config)


@pytest.mark.slow
def test_a_gate_on_a_baseline_run_stops_the_main_job_with_one_line_and_exit_2(tmp_path):
    workdir = tmp_path / "w"
    result = run_main(workdir, "--config.scone.gate=true", devices=1)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("scone_jax: error:")]
    assert lines == ["scone_jax: error: scone.gate=True is set on a run without SCONE (scone.enabled=False): it "
                     "applies to the f-gram model only. Fix: set --config.scone.enabled=True, or leave scone.gate at "
                     "False."]
    assert "Traceback" not in result.stderr and not (workdir / "checkpoints").exists()


@pytest.mark.parametrize("settings,message", [
    ({"combine": "sum"}, r"^Unknown scone\.combine='sum'; valid: replace, add\.$"),
    ({"output_projection_init": "ones"}, r"^Unknown scone\.output_projection_init='ones'; valid: normal, zeros\.$"),
    ({"row_scale": "unit"}, r"^Unknown scone\.row_scale='unit'; valid: raw, token_rms\.$"),
    ({"combine": "add", "output_projection_init": "zeros", "row_scale": "token_rms"},
     r"^scone\.output_projection_init='zeros' with scone\.row_scale='token_rms': the rows start at 0"),
    ({"d_model": 32, "num_heads": 2, "output_projection_init": "zeros"},
     r"^scone\.output_projection_init='zeros' with scone\.combine='replace' feeds the decoder zeros .* Fix: "
     r"--config\.scone\.combine=add"),
])
def test_combinations_that_cannot_start_are_refused_in_one_line(settings, message):
    """scone.combine and scone.output_projection_init on a SCONE run: unknown values and a zero projection under
    replacement (zeros at every matched position) are refused; a zero projection with combine='add', or with the
    gate, is accepted, at another width and at the main model's. Caught: the gate not counted as a start."""
    config = small_config()
    config.scone.update(dict(enabled=True) | settings)
    with pytest.raises(ValueError, match=message) as e:
        config_lib.validate(config)
    assert "\n" not in str(e.value)
    for accepted in ({"combine": "add"}, {"gate": True}, {"combine": "add", "d_model": 0, "num_heads": 0}):
        config = small_config()
        config.scone.update(dict(enabled=True, d_model=32, num_heads=2, output_projection_init="zeros") | accepted)
        config_lib.validate(config)


@pytest.mark.parametrize("key,value", [("learning_rate_multiplier", 0.5), ("gate", True)])
def test_a_resume_that_changes_the_gate_or_the_multiplier_is_refused_naming_the_key(tmp_path, key, value):
    """The resume check train.run makes before restoring (RESUME_KEYS), on a checkpoint saved with the defaults.
    Caught: the key missing from RESUME_KEYS (the multiplier then resumes silently; the gate fails later in the
    shape check, naming a parameter instead of the key)."""
    saved = small_config()
    saved.scone.enabled = True
    ckpt = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    ckpt.save(3, {"x": jnp.zeros(2)}, {"config": saved.to_dict(), "train_data": {}})
    config = small_config()
    config.scone.enabled = True
    run_lib.check_resume(ckpt, (3, ckpt.read_checkpoint_meta(3)), config, set(), {})  # unchanged: resumes
    config.scone[key] = value
    with pytest.raises(checkpoint.CheckpointMismatchError,
                       match=rf"/3 with a config that changes .*: scone\.{key}: {saved.scone[key]!r} -> {value!r}\. "
                             rf".*--allow_config_change=scone\.{key}\.$"):
        run_lib.check_resume(ckpt, (3, ckpt.read_checkpoint_meta(3)), config, set(), {})
    ckpt.close()


def test_the_quality_study_takes_them_as_overrides(tmp_path):
    """tools/bench_quality.py's --config.KEY=VALUE sets them on configs/quality.py's arms, whose defaults are the
    method's but the delay of 6.5% of the run chosen on validation; the per-layer delay follows each arm's f-gram depth, and
    a baseline arm refuses the gate and the multiplier. Caught: the per-layer delay not multiplied by
    scone.num_layers (fgram_model_delay returning P)."""
    from scone_jax.study.study import Study

    overrides = {"scone.learning_rate_multiplier": 0.5, "scone.gate": True, "train.fgram_model_delay_fraction": 0.0,
                 "train.fgram_model_delay_steps_per_layer": 20}
    arms = ["baseline", "scone_fgram0.5x", "scone", "scone_fgram2x"]
    plain = Study(str(tmp_path), arms, 3_000_000, 3_000_000, ["0.001"], {}, "", False, {})
    study = Study(str(tmp_path), arms, 3_000_000, 3_000_000, ["0.001"], {}, "", False, overrides)
    for arm, delay in (("scone_fgram0.5x", 20), ("scone", 40), ("scone_fgram2x", 80)):
        config = study.config(arm, "0.001")
        config_lib.validate(config)
        assert (config.scone.learning_rate_multiplier, config.scone.gate, optimizer.fgram_model_delay(config)) == (
            0.5, True, delay)
        default = plain.config(arm, "0.001")
        assert (default.scone.learning_rate_multiplier, default.scone.gate, optimizer.fgram_model_delay(default)) == (
            1.0, False, 24)  # 6.5% of 3M tokens' 367 steps
    with pytest.raises(ValueError, match=r"^scone\.learning_rate_multiplier=0\.5 is set on a run without SCONE"):
        config_lib.validate(study.config("baseline", "0.001"))
