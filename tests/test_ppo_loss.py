"""experiments/ppo.py's loss terms and advantage normalisation against NumPy written from the papers, on fixed
inputs: the clipped surrogate (Schulman et al. 2017, eq. 7), the clipped value loss and the entropy bonus
(PureJaxRL's and CleanRL's PPO), the approximate KL (Schulman's "k3" estimator, `(r - 1) - log r`), and the
rollout's advantages normalised by their mean and standard deviation. None of this touches an environment, so
these tests run without gymnax (tests/test_ppo.py, which runs PPO itself, is skipped without it)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.experiment import load_experiment

ppo = load_experiment("ppo")

CLIP = 0.2
ENVS, TIME, ACTIONS = 2, 4, 3
# The new policy's probability of each action over the old one's, on both sides of [1 - CLIP, 1 + CLIP] and inside
# it, each side with an advantage of either sign: the four cases of the paper's Figure 1 and the flat middle.
RATIOS = np.array([0.5, 0.85, 1.0, 1.1, 1.3, 0.7, 1.25, 0.95])
ADVANTAGES = np.array([1.5, -0.4, 0.8, 2.0, 1.2, -1.0, -0.6, -2.5])
# New values, the rollout's (old) values and the targets: value moves inside and beyond the clip range, up and
# down, with targets on either side, so the clipped and the unclipped error each win somewhere.
VALUES = np.array([1.0, 0.5, -0.3, 2.0, 0.0, 1.1, -1.0, 0.4])
OLD_VALUES = np.array([0.9, 1.0, 0.2, 1.5, 0.1, 1.0, -0.5, 0.4])
TARGETS = np.array([2.0, 0.0, 0.5, 1.0, -1.0, 1.05, -2.0, 0.9])


class Passthrough(eqx.Module):
    """A discrete policy whose observation is its output: the first `ACTIONS` entries its logits, the last its
    value, so the test chooses both (`log_std` None: `ppo.log_prob` and `ppo.entropy` take it as categorical)."""

    log_std: None = None

    def __call__(self, observation):
        return observation[:-1], observation[-1]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def loss_inputs():
    """The minibatch (`ppo.Transitions`, rows: environments) and, in float64, the logits and actions behind it."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(ENVS * TIME, ACTIONS)) * 1.5
    actions = np.array([0, 2, 1, 1, 0, 2, 2, 0])
    new_log_prob = log_softmax(logits)[np.arange(ENVS * TIME), actions]
    old_log_prob = new_log_prob - np.log(RATIOS)  # so that exp(new - old) is RATIOS

    def rows(x, dtype=jnp.float32):
        return jnp.asarray(np.asarray(x).reshape(ENVS, TIME, *np.shape(x)[1:]), dtype)

    zeros = jnp.zeros((ENVS, TIME))
    batch = ppo.Transitions(
        observation=rows(np.concatenate([logits, VALUES[:, None]], axis=1)),
        action=rows(actions, jnp.int32),
        log_prob=rows(old_log_prob),
        value=rows(OLD_VALUES),
        reward=zeros,
        next_value=zeros,
        terminated=zeros.astype(bool),
        done=zeros.astype(bool),
        advantage=rows(ADVANTAGES),
        target=rows(TARGETS),
    )
    return batch, logits


def ppo_loss(value_coef=0.5, entropy_coef=0.01):
    batch, logits = loss_inputs()
    loss, (metrics, state) = ppo.PPOLoss(CLIP, value_coef, entropy_coef)(Passthrough(), None, batch, jax.random.key(0))
    assert state is None
    return float(loss), {k: float(v) for k, v in metrics.items()}, logits


def test_the_clipped_surrogate_takes_the_pessimistic_bound_on_both_sides_of_the_clip_range():
    """The policy loss is minus the mean of min(r A, clip(r, 1 - eps, 1 + eps) A), written here as the paper's
    cases: with A > 0 the ratio is capped at 1 + eps, with A < 0 floored at 1 - eps, and never raised."""
    _, metrics, _ = ppo_loss()
    capped = np.where(ADVANTAGES > 0, np.minimum(RATIOS, 1 + CLIP), np.maximum(RATIOS, 1 - CLIP))
    expected = -np.mean(capped * ADVANTAGES)
    np.testing.assert_allclose(metrics["policy_loss"], expected, rtol=1e-5, err_msg="policy_loss")
    # The cases are all there: a ratio outside the range that counts (capped) and one that does not (kept).
    assert np.any(capped != RATIOS) and np.any((np.abs(RATIOS - 1) > CLIP) & (capped == RATIOS))
    np.testing.assert_allclose(
        metrics["clip_fraction"], np.mean(np.abs(RATIOS - 1) > CLIP), rtol=1e-6, err_msg="clip_fraction"
    )


def test_the_value_loss_is_the_larger_of_the_clipped_and_unclipped_squared_errors():
    """0.5 mean(max((V - R)^2, (V_clipped - R)^2)), V_clipped the new value held within eps of the rollout's."""
    _, metrics, _ = ppo_loss()
    clipped = np.clip(VALUES, OLD_VALUES - CLIP, OLD_VALUES + CLIP)
    errors, clipped_errors = (VALUES - TARGETS) ** 2, (clipped - TARGETS) ** 2
    assert np.any(clipped_errors > errors) and np.any(clipped_errors < errors)  # each wins somewhere
    expected = 0.5 * np.mean(np.maximum(errors, clipped_errors))
    np.testing.assert_allclose(metrics["value_loss"], expected, rtol=1e-5, err_msg="value_loss")


def test_the_approximate_kl_is_the_k3_estimator_of_the_ratios():
    """mean((r - 1) - log r): Schulman's unbiased, never-negative estimator of KL(old || new) from the sampled
    actions' ratios."""
    _, metrics, _ = ppo_loss()
    expected = np.mean((RATIOS - 1) - np.log(RATIOS))
    np.testing.assert_allclose(metrics["approx_kl"], expected, rtol=1e-5, err_msg="approx_kl")


def test_the_loss_adds_the_weighted_value_loss_and_subtracts_the_weighted_entropy():
    """loss = policy loss + c_v value loss - c_e entropy, the entropy that of the categorical over the logits."""
    loss, metrics, logits = ppo_loss(value_coef=0.7, entropy_coef=0.3)
    log_p = log_softmax(logits)
    entropy = np.mean(-np.sum(np.exp(log_p) * log_p, axis=-1))
    np.testing.assert_allclose(metrics["entropy"], entropy, rtol=1e-5, err_msg="entropy")
    expected = metrics["policy_loss"] + 0.7 * metrics["value_loss"] - 0.3 * entropy
    np.testing.assert_allclose(loss, expected, rtol=1e-5, err_msg="loss")


@pytest.mark.parametrize("shape", [(4, 6), (3, 5)])  # an even and an odd count (tree_sum's pairs and its odd one)
def test_global_mean_and_std_are_numpys(shape):
    """The mean and the population standard deviation (ddof 0) of all the values, as np.mean and np.std."""
    x = np.random.default_rng(1).normal(3.0, 2.0, shape)
    mean, std = ppo.global_mean_and_std(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(float(mean), np.mean(x), rtol=1e-5, err_msg="mean")
    np.testing.assert_allclose(float(std), np.std(x), rtol=1e-5, err_msg="std")


def test_advantages_are_normalised_by_the_global_rollouts_mean_and_std_on_any_split():
    """(A - mean) / (std + 1e-8) over every environment's advantages; with the environments split over two
    devices (`vmap` with an axis name standing in for them), each device's rows by the global statistics."""
    advantages = np.random.default_rng(2).normal(-1.0, 3.0, (4, 6))
    expected = (advantages - np.mean(advantages)) / (np.std(advantages) + 1e-8)
    whole = ppo.normalised_advantages(jnp.asarray(advantages, jnp.float32), None)
    np.testing.assert_allclose(whole, expected, rtol=1e-5, atol=1e-6, err_msg="one device")
    shares = jnp.asarray(advantages.reshape(2, 2, 6), jnp.float32)  # device d holds environments 2d and 2d + 1
    split = jax.vmap(lambda rows: ppo.normalised_advantages(rows, "devices"), axis_name="devices")(shares)
    np.testing.assert_allclose(split.reshape(4, 6), expected, rtol=1e-5, atol=1e-6, err_msg="two devices")
