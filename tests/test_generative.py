"""The two kinds of research that are not supervised classification, through the engine: `gan` (two
networks, two optimizers, alternating updates: a `Step` of its own) and `diffusion` (a `SupervisedStep`
over images alone), judged by the Fréchet distance in the features of a classifier `images` trained on the
same digits. Placements, EMA and `--deterministic-reduction` on 1 and 4 devices are the combination
grid's (tests/test_combinations.py); here: what each run leaves, resume after SIGTERM, a vmapped population,
`load_run`, `scripts/export` and `scripts/sample`."""

import os
import signal

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest
from _image_formats import native_digits

from research import load_run
from research.errors import ConfigError, Preempted
from research.experiment import load_experiment
from research.judge import load_judge, real_frechet_distance
from research.nn import Generator, UNet, load_weights
from research.provenance import parameter_counts
from research.services import RunDir, checkpoint_digest
from research.tools import export, sample, sweep
from research.train import Track

gan = load_experiment("gan")
diffusion = load_experiment("diffusion")
images = load_experiment("images")

# Long enough to learn, measurably (the learning checks below): at the default rate of 2e-4, 8 steps left the GAN's
# fid where it started (3.27, untrained 3.19); 100 steps at 2e-3 cost little, as compiling dominates these runs.
GAN = {"latent": 8, "features": 4, "batch_size": 16, "critic_steps": 2, "log_every": 4, "steps_per_call": 2}
GAN_RUN = {**GAN, "steps": 100, "eval_every": 50, "lr": 2e-3, "ema_decay": 0.9, "checkpoint_minutes": 0.0}
# The default schedule of 1,000 steps: DDPM's betas over only 20 keep 82% of the image at the last step, so sampling
# from pure noise starts where training never was (fid did not fall in 300 steps). An EMA of 0.9: the default
# 0.999 averages a run this short almost uniformly from its start (fid 1.35, the trained weights' 1.11).
DIFFUSION = {"features": 8, "levels": 1, "sample_steps": 20, "batch_size": 16, "lr": 5e-3, "ema_decay": 0.9}
DIFFUSION_RUN = {**DIFFUSION, "steps": 600, "eval_every": 300, "log_every": 50}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """256 training and 64 test images of scikit-learn's digits, 8x8 grey, as it ships them."""
    train, test = native_digits(256, 64)
    path = tmp_path_factory.mktemp("digits") / "digits8.npz"
    np.savez(path, x_train=train.inputs, y_train=train.labels, x_test=test.inputs, y_test=test.labels)
    return path


@pytest.fixture(scope="module")
def judge_run(digits, tmp_path_factory):
    """A small classifier `images` trained on those digits: the judge of the generated ones."""
    path = tmp_path_factory.mktemp("judge") / "judge"
    config = images.Config.from_options(
        data=str(digits),
        epochs=3,
        features=4,
        blocks=1,
        batch_size=32,
        crop_padding=0,
        run_dir=str(path),
        progress=False,
    )
    images.main(config)
    return path


def train(module, root, name, **options):
    config = module.Config.from_options(run_dir=str(root / name), progress=False, **options)
    return module.main(config), root / name


@pytest.fixture(scope="module")
def gan_run(digits, judge_run, tmp_path_factory):
    return train(gan, tmp_path_factory.mktemp("gan"), "run", data=str(digits), judge=str(judge_run), **GAN_RUN)


@pytest.fixture(scope="module")
def diffusion_run(digits, judge_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("diffusion")
    return train(diffusion, root, "run", data=str(digits), judge=str(judge_run), **DIFFUSION_RUN)


def grid_size(count, image=8):
    side, scale = int(np.ceil(np.sqrt(count))), max(2, 64 // image)
    return ((-(-count // side)) * (image + 1) + 1) * scale, (side * (image + 1) + 1) * scale


def without_timing(path):
    return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(path).read_metrics()]


@pytest.mark.slow
def test_a_gan_run_trains_both_networks_and_reports_the_frechet_distance_of_its_samples(gan_run):
    """100 steps learn: the EMA generator's fid ends below 0.7 of the untrained generator's. Measured on a CPU
    (`--seed` 0, 1, 2): 1.15 of 3.19, 1.05 of 3.85, 1.33 of 3.30, fractions 0.36, 0.27, 0.40; 0.7 is about
    halfway between the worst of them and no learning at all (1). With the learning rate at 1e-12 the fid stays
    the untrained one and this fails."""
    summary, path = gan_run
    run = RunDir(path)
    for key in ("test_fid", "test_raw_fid", "fid_real_vs_real", "fid_untrained", "train_d_loss", "train_g_loss"):
        assert np.isfinite(summary[key]) and summary[key] >= 0, key
    fid, untrained = summary["test_fid"], summary["fid_untrained"]
    assert fid < 0.7 * untrained, f"fid {fid:.4g}: not below 0.7 of the untrained generator's {untrained:.4g}"
    assert summary["step"] == 100 and "test_accuracy" not in summary and 0 < summary["test_d_real"] < 1
    records = run.read_metrics()
    logged = {k for r in records for k in r}
    assert {"train/d_loss", "train/g_loss", "train/d_real", "train/d_fake", "train/d_grad_norm"} <= logged
    assert [r["step"] for r in records if "test/fid" in r] == [50, 100]
    config = run.read_config()
    state = load_run(path).state
    counts = {name: parameter_counts(network)["total"] for name, network in state.networks().items()}
    assert config["parameters"] == {"total": sum(counts.values()), "by_field": counts}
    assert config["headline"] == {"metric": "fid", "goal": "min", "percent": False}
    assert matplotlib.image.imread(path / "samples.png").shape[:2] == grid_size(64)
    assert (path / "curves.png").exists()
    # Two discriminator updates a step: its Adam has counted 200, the generator's 100.
    assert int(state.discriminator.opt_state.count) == 200 and int(state.generator.opt_state.count) == 100


@pytest.mark.slow
def test_an_untrained_generator_is_far_from_the_data_and_the_data_is_close_to_itself(gan_run, digits, judge_run):
    """The judge's Fréchet distance tells generated images from real ones: the untrained generator's noise
    is many times farther from the test images than as many training images are."""
    summary, _ = gan_run
    data = np.load(digits)
    real = real_frechet_distance(load_judge(judge_run, (8, 8, 1)), data["x_train"], data["x_test"])
    assert real == pytest.approx(summary["fid_real_vs_real"], rel=1e-6)
    assert summary["fid_untrained"] > 5 * real


@pytest.mark.slow
def test_a_gan_stopped_by_sigterm_resumes_to_the_bits_of_a_run_never_stopped(gan_run, digits, judge_run, tmp_path):
    """SIGTERM at step 4 (in this process: the engine's handler takes it): the run checkpoints there and
    raises `Preempted`; `--resume auto` continues it to the checkpoint and the records of the run never
    stopped."""
    _, straight = gan_run
    config = gan.Config.from_options(
        data=str(digits), judge=str(judge_run), run_dir=str(tmp_path / "stopped"), progress=False, **GAN_RUN
    )
    original = Track.__call__  # a hook that runs at every stop

    def signal_at_step_4(self, info):
        original(self, info)
        if info.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Track, "__call__", signal_at_step_4)
        with pytest.raises(Preempted, match="stopped by SIGTERM at step 4 of 100; its checkpoint is saved"):
            gan.main(config)
    assert [p.name for p in RunDir(tmp_path / "stopped").checkpoint_paths()] == ["step_000000004"]
    gan.main(config.replace(resume="auto"))
    final = [RunDir(path).checkpoint_paths()[-1] for path in (tmp_path / "stopped", straight)]
    assert final[0].name == final[1].name == "step_000000100"
    assert checkpoint_digest(final[0]) == checkpoint_digest(final[1])
    assert without_timing(tmp_path / "stopped") == without_timing(straight)


@pytest.mark.slow
def test_a_vmapped_population_of_gans_equals_its_runs_alone(gan_run, digits, judge_run, tmp_path):
    """`scripts/sweep gan seed=0,1 --vmapped`: one compiled program for both seeds; the seed-0 member's run
    equals the seed-0 run alone (its metrics, its generator, its fid) and has its own samples.png."""
    summary, alone = gan_run
    flags = ["--data", str(digits), "--judge", str(judge_run)]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in GAN_RUN.items()]
    sweep.main(["gan", "seed=0,1", "--vmapped", "--sweep-dir", str(tmp_path / "v"), "--", *flags])
    together = tmp_path / "v" / "seed=0"
    a, b = without_timing(together), without_timing(alone)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose([x[k] for k in sorted(x)], [y[k] for k in sorted(y)], rtol=1e-4, atol=1e-6)
    assert RunDir(together).read_summary()["test_fid"] == pytest.approx(summary["test_fid"], rel=1e-3)
    for p, q in zip(jax.tree.leaves(load_run(together).model), jax.tree.leaves(load_run(alone).model), strict=True):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-4, atol=1e-6)
    other = load_run(tmp_path / "v" / "seed=1").model
    assert not np.allclose(jax.tree.leaves(other)[0], jax.tree.leaves(load_run(alone).model)[0])
    assert (together / "samples.png").exists() and (tmp_path / "v" / "seed=1" / "samples.png").exists()


@pytest.mark.slow
def test_a_gan_run_loads_exports_its_generator_and_samples(gan_run, tmp_path, capsys):
    _, path = gan_run
    run = load_run(path)
    assert isinstance(run.model, Generator) and isinstance(run.ema_model, Generator) and run.step == 100
    export.main([str(path), "--ema", "-o", str(tmp_path / "generator.safetensors")])
    like = Generator(8, 8, 8, 1, 4, key=jax.random.key(1))
    loaded, _ = load_weights(tmp_path / "generator.safetensors", like)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(run.ema_model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sample.main([str(path), "--count", "10", "--seed", "3", "-o", str(tmp_path / "ten.png")])
    assert matplotlib.image.imread(tmp_path / "ten.png").shape[:2] == grid_size(10)
    drawn = sample.draw_images(path, 10, seed=3)
    assert drawn.shape == (10, 8, 8, 1) and drawn.dtype == np.uint8
    np.testing.assert_array_equal(drawn, sample.draw_images(path, 10, seed=3))
    with pytest.raises(SystemExit) as exit_info:
        sample.main([str(path), "--prompt", "hello"])
    assert exit_info.value.code == 2
    assert "--prompt" in capsys.readouterr().err


@pytest.mark.slow
def test_a_diffusion_run_denoises_samples_with_its_ema_and_reports_its_fid(diffusion_run, tmp_path):
    """600 steps learn: the EMA's fid ends below 0.8 of the untrained model's, its test loss (the noise's mean
    squared error: 1.09 untrained) below 0.6. Measured on a CPU (`--seed` 0, 1, 2): fid 1.09 of 2.04, 0.96 of
    2.19, 1.02 of 1.59, fractions 0.53, 0.44, 0.64 (0.8 about halfway between the worst and 1, no learning);
    test loss 0.142, 0.138, 0.141. With the learning rate at 1e-12 both stay the untrained ones and this fails."""
    summary, path = diffusion_run
    for key in ("test_loss", "test_fid", "test_raw_fid", "test_raw_loss", "train_loss", "fid_real_vs_real"):
        assert np.isfinite(summary[key]), key
    fid, untrained = summary["test_fid"], summary["fid_untrained"]
    assert fid < 0.8 * untrained, f"fid {fid:.4g}: not below 0.8 of the untrained model's {untrained:.4g}"
    assert 0 < summary["test_loss"] < 0.6, f"test loss {summary['test_loss']:.4g}: not below 0.6 (untrained: 1.09)"
    run = load_run(path)
    assert isinstance(run.model, UNet) and run.ema_model is not None  # --ema-decay 0.9
    assert matplotlib.image.imread(path / "samples.png").shape[:2] == grid_size(64)
    sample.main([str(path), "--count", "4", "-o", str(tmp_path / "four.png")])
    assert matplotlib.image.imread(tmp_path / "four.png").shape[:2] == grid_size(4)


def test_the_generative_experiments_refuse_bad_options_in_one_line(digits):
    def refused(module, **options):
        with pytest.raises(ConfigError) as info:
            module.setup(module.Config.from_options(**{"data": str(digits), **options}))
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "--batch-size 200 x --critic-steps 2 = 400 images" in refused(gan, batch_size=200, critic_steps=2)
    assert "--sample-steps 30 is more than --diffusion-steps 20" in refused(
        diffusion, diffusion_steps=20, sample_steps=30
    )
    assert "--levels 4 halves the resolution 4 times; 8x8 does not" in refused(diffusion, levels=4)
    assert "--data names the images" in refused(gan, data=None)


# -- the methods against NumPy written from the papers, on fixed inputs: fast, no training ---------------------


def linear_alpha_bars(steps):
    """DDPM's schedule by hand, in float64: beta_t from 1e-4 to 0.02 linearly over T steps (Ho et al. 2020, sec.
    4), alpha_bar_t the product of 1 - beta_s for s <= t, a loop."""
    alpha_bars, product = [], 1.0
    for t in range(steps):
        product *= 1 - (1e-4 + (0.02 - 1e-4) * t / (steps - 1))
        alpha_bars.append(product)
    return np.array(alpha_bars)


class AffineNoise(eqx.Module):
    """A stand-in noise predictor, eps(x, t) = 0.5 x + t - 0.3: simple to write in NumPy, and both its inputs (the
    noisy image and the time) change what it predicts."""

    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)

    def __call__(self, x, t, *, key=None):
        return 0.5 * x + t - 0.3


def affine_noise(x, t):
    return 0.5 * x + t - 0.3


class Oracle(eqx.Module):
    """A perfect noise predictor for `image`: the noise that makes `x` of `image` at the step of time `t` (`x =
    sqrt(alpha_bar) image + sqrt(1 - alpha_bar) noise`, Ho et al. 2020, eq. 4), whatever `x` is."""

    image: jax.Array
    alpha_bars: jax.Array
    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)

    def __call__(self, x, t, *, key=None):
        a = self.alpha_bars[jnp.round(t * self.alpha_bars.shape[0]).astype(jnp.int32)]
        return (x - jnp.sqrt(a) * self.image) / jnp.sqrt(1 - a)


@pytest.mark.parametrize("steps", [2, 20, 1000])
def test_the_noise_schedule_is_ddpms_linear_one(steps):
    """`Schedule.alpha_bars` against the hand loop: each step keeps 1 - beta_t of the one before, beta_t linear
    from 1e-4 to 0.02; at DDPM's T = 1000 the last keeps 4.04e-5 of the image (weight 0.0064: nearly pure
    noise, where sampling starts)."""
    alpha_bars = diffusion.Schedule(steps).alpha_bars
    assert alpha_bars.dtype == np.float32 and alpha_bars.shape == (steps,)
    np.testing.assert_allclose(alpha_bars, linear_alpha_bars(steps), rtol=1e-6, err_msg="alpha_bars")
    if steps == 1000:
        np.testing.assert_allclose(alpha_bars[-1], 4.0358e-5, rtol=1e-4, err_msg="alpha_bar_T")


@pytest.mark.parametrize(("diffusion_steps", "sample_steps"), [(10, 1), (20, 4)])
def test_ddim_recovers_the_image_exactly_when_the_model_predicts_the_true_noise(diffusion_steps, sample_steps):
    """DDIM with eta 0 (Song et al. 2021, eq. 12) from any noise, its noise predicted perfectly (`Oracle`), lands on
    the image in one step or several: each step's estimate of the image is the image, to float rounding."""
    image = np.random.default_rng(0).uniform(-1, 1, (4, 4, 2)).astype(np.float32)
    alpha_bars = jnp.asarray(linear_alpha_bars(diffusion_steps), jnp.float32)
    oracle = Oracle(jnp.asarray(image), alpha_bars, 4, 4, 2)
    sampler = diffusion.DDIM(diffusion.Schedule(diffusion_steps), sample_steps)
    drawn = sampler(oracle, None, jax.random.split(jax.random.key(1), 3))
    np.testing.assert_allclose(drawn, np.broadcast_to(image, (3, 4, 4, 2)), atol=2e-5, err_msg="recovered image")


def test_ddim_takes_the_steps_and_updates_of_a_hand_written_sampler():
    """Four DDIM steps of a 20-step schedule with a stand-in model, against a NumPy loop over Song et al.'s eta-0
    update: steps evenly spaced from T - 1 down to 0 (19, 13, 6, 0), each estimating the image from the predicted
    noise (held to [-1, 1]) and moving to the next step's noise level, the last to the image itself."""
    total, steps, keys = 20, 4, jax.random.split(jax.random.key(2), 2)
    drawn = diffusion.DDIM(diffusion.Schedule(total), steps)(AffineNoise(4, 4, 2), None, keys)
    alpha_bars, taus = linear_alpha_bars(total), [19, 13, 6, 0]
    for key, image in zip(keys, np.asarray(drawn), strict=True):
        x = np.asarray(jax.random.normal(key, (4, 4, 2)), np.float64)  # the sampler's noise: its key's
        for i, t in enumerate(taus):
            a, a_next = alpha_bars[t], alpha_bars[taus[i + 1]] if i + 1 < len(taus) else 1.0
            noise = affine_noise(x, t / total)
            estimate = np.clip((x - np.sqrt(1 - a) * noise) / np.sqrt(a), -1, 1)
            x = np.sqrt(a_next) * estimate + np.sqrt(1 - a_next) * noise
        np.testing.assert_allclose(image, x, rtol=1e-5, atol=1e-5, err_msg="DDIM sample")


def test_the_denoising_loss_is_the_mean_squared_error_of_the_predicted_noise():
    """DDPM's simple loss (Ho et al. 2020, eq. 14) by hand: each image in [-1, 1] noised at its step t with its
    noise (drawn from its key, one of the loss's `keys`; then split into the step's key and the noise's), the
    model given (x_t, t / T), the squared error to the noise averaged over pixels and images."""
    total, count = 20, 4
    images = np.random.default_rng(3).integers(0, 256, (count, 4, 4, 1), dtype=np.uint8)
    key = jax.random.key(4)
    loss, (metrics, state) = diffusion.DenoisingLoss(diffusion.Schedule(total))(
        AffineNoise(4, 4, 1), None, jnp.asarray(images), jax.random.split(key, count)
    )
    alpha_bars, errors, times = linear_alpha_bars(total), [], set()
    for image, image_key in zip(images, jax.random.split(key, count), strict=True):
        step_key, noise_key = jax.random.split(image_key)
        t = int(jax.random.randint(step_key, (), 0, total))
        noise = np.asarray(jax.random.normal(noise_key, image.shape), np.float64)
        noisy = np.sqrt(alpha_bars[t]) * (image / 127.5 - 1) + np.sqrt(1 - alpha_bars[t]) * noise
        errors.append(np.mean((affine_noise(noisy, t / total) - noise) ** 2))
        times.add(t)
    assert len(times) > 1 and state is None  # the images' steps differ: the time input is tested
    np.testing.assert_allclose(float(loss), np.mean(errors), rtol=1e-5, err_msg="denoising loss")
    assert float(metrics["loss"]) == float(loss)


class LinearCritic(eqx.Module):
    """A stand-in discriminator: the logit sum(weight * x) + bias."""

    weight: jax.Array
    bias: jax.Array

    def __call__(self, x, *, key=None):
        return jnp.sum(self.weight * x) + self.bias


class TanhGenerator(eqx.Module):
    """A stand-in generator: tanh(z) as an image (its latent as many as the image's values)."""

    height: int = eqx.field(static=True)
    width: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)

    def __call__(self, z, *, key=None):
        return jnp.tanh(z).reshape(self.height, self.width, self.channels)


def gan_logits(images, key, weight, bias):
    """By hand, in float64: the critic's logits of the real images (in [-1, 1]) and of as many generated ones, each
    from its row's latent, drawn from the row's key (`keys[i]`: here `jax.random.split(key, rows)[i]`)."""
    latent = weight.size
    latents = [np.asarray(jax.random.normal(k, (latent,)), np.float64) for k in jax.random.split(key, len(images))]
    fakes = [np.tanh(z).reshape(weight.shape) for z in latents]
    real = np.array([np.sum(weight * (image / 127.5 - 1)) + bias for image in images])
    return real, np.array([np.sum(weight * fake) + bias for fake in fakes])


def test_the_gan_losses_are_the_cross_entropies_of_the_original_gan():
    """Goodfellow et al. 2014: the discriminator minimises -log D(real) - log(1 - D(fake)) and the generator the
    non-saturating -log D(fake) (their sec. 3), D the sigmoid of the logit; written here as logs of sigmoids, not
    the code's softplus. Logits of both signs and a few units: each term's sign matters."""
    rng = np.random.default_rng(5)
    images = rng.integers(0, 256, (6, 4, 4, 1), dtype=np.uint8)
    weight, bias, key = rng.normal(0, 0.8, (4, 4, 1)), 0.3, jax.random.key(6)
    critic = LinearCritic(jnp.asarray(weight, jnp.float32), jnp.asarray(bias, jnp.float32))
    generator, batch = TanhGenerator(4, 4, 1), jnp.asarray(images)
    real, fake = gan_logits(images, key, weight, bias)
    keys = jax.random.split(key, len(images))
    assert (real > 1).any() and (real < -1).any() and (fake > 1).any() and (fake < -1).any()
    d_real, d_fake = 1 / (1 + np.exp(-real)), 1 / (1 + np.exp(-fake))

    d_loss, (metrics, _) = gan.DiscriminatorLoss(generator, weight.size)(critic, None, batch, keys)
    expected = np.mean(-np.log(d_real)) + np.mean(-np.log(1 - d_fake))
    np.testing.assert_allclose(float(d_loss), expected, rtol=1e-5, err_msg="discriminator loss")
    np.testing.assert_allclose(float(metrics["d_real"]), np.mean(d_real), rtol=1e-5, err_msg="d_real")
    np.testing.assert_allclose(float(metrics["d_fake"]), np.mean(d_fake), rtol=1e-5, err_msg="d_fake")

    g_loss, (g_metrics, _) = gan.GeneratorLoss(critic, weight.size)(generator, None, batch, keys)
    np.testing.assert_allclose(float(g_loss), np.mean(-np.log(d_fake)), rtol=1e-5, err_msg="generator loss")
    assert float(g_metrics["g_loss"]) == float(g_loss)
