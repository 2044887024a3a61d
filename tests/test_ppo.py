"""experiments/ppo.py: PPO on gymnax's classic control, its step making its own data through the engine."""

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.nn import ActorCritic
from research.services import RunDir, checkpoint_digest

pytest.importorskip("gymnax")

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("ppo_experiment", ROOT / "experiments" / "ppo.py")
ppo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ppo)

TINY = [  # 8 environments, 16 steps each a rollout: 8 steps of 128 environment steps
    *("--env-steps 1024 --batch-size 8 --rollout-steps 16 --minibatches 2 --epochs 2 --eval-episodes 4").split(),
    *("--steps-per-call 2 --log-every 2 --eval-every 4 --no-progress").split(),
]


def run_ppo(cwd, *args, timeout=300):
    return subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "ppo.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(run_dir):
    return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in RunDir(run_dir).read_metrics()]


def gae_reference(rewards, values, next_values, terminated, done, gamma, lam):
    advantages, advantage = np.zeros(len(rewards)), 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_values[t] * (1 - terminated[t]) - values[t]
        advantage = delta + gamma * lam * (1 - done[t]) * advantage
        advantages[t] = advantage
    return advantages, advantages + values


def test_gae_bootstraps_a_truncated_episode_and_not_a_terminated_one():
    rng = np.random.default_rng(0)
    rewards, values, next_values = (rng.normal(size=12).astype(np.float32) for _ in range(3))
    terminated = np.zeros(12, bool)
    done = np.zeros(12, bool)
    terminated[3] = done[3] = True  # an episode that failed
    done[8] = True  # one cut by the time limit: it bootstraps from its final observation's value
    advantages, targets = ppo.gae(*map(jnp.asarray, (rewards, values, next_values, terminated, done)), 0.99, 0.95)
    expected, expected_targets = gae_reference(rewards, values, next_values, terminated, done, 0.99, 0.95)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(targets, expected_targets, rtol=1e-5, atol=1e-6)


def test_log_probabilities_and_entropies_are_those_of_the_distributions():
    key = jax.random.key(0)
    discrete = ActorCritic(4, 3, key=key)
    logits = jnp.array([0.5, -1.0, 2.0])
    p = jax.nn.softmax(logits)
    np.testing.assert_allclose(ppo.log_prob(discrete, logits, jnp.array(2)), jnp.log(p[2]), rtol=1e-6)
    np.testing.assert_allclose(ppo.entropy(discrete, logits), -jnp.sum(p * jnp.log(p)), rtol=1e-6)
    gaussian = ActorCritic(3, 2, continuous=True, key=key)
    gaussian = eqx.tree_at(lambda m: m.log_std, gaussian, jnp.array([0.3, -0.7]))
    mean, action = jnp.array([0.1, -0.2]), jnp.array([0.4, 0.5])
    expected = jnp.sum(jax.scipy.stats.norm.logpdf(action, mean, jnp.exp(jnp.array([0.3, -0.7]))))
    np.testing.assert_allclose(ppo.log_prob(gaussian, mean, action), expected, rtol=1e-6)
    expected_entropy = jnp.sum(0.5 * jnp.log(2 * jnp.pi * jnp.e * jnp.exp(2 * jnp.array([0.3, -0.7]))))
    np.testing.assert_allclose(ppo.entropy(gaussian, mean), expected_entropy, rtol=1e-6)


def test_the_initial_policy_is_near_uniform_and_its_values_near_zero():
    policy = ActorCritic(4, 2, key=jax.random.key(1))
    logits, values = jax.vmap(policy)(jax.random.normal(jax.random.key(2), (64, 4)))
    assert float(jnp.max(jnp.abs(jax.nn.softmax(logits) - 0.5))) < 0.05
    assert logits.shape == (64, 2) and values.shape == (64,)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--minibatches", "3"], "--minibatches 3 must divide --rollout-steps 16"),
        (["--env-steps", "100"], "--env-steps 100 is less than one rollout"),
        (["--precision", "bf16"], "computes in float32 only"),
        (["--gamma", "1.5"], "--gamma must be in [0, 1] (got 1.5)"),  # else its returns grow until a NaN loss
    ],
)
def test_bad_combinations_are_refused_in_one_line_before_any_work(tmp_path, args, message):
    result = run_ppo(tmp_path, *TINY, *args, "--run-dir", "run")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_without_gymnax_the_run_is_refused_naming_the_install(tmp_path):
    code = (
        "import sys; sys.modules['gymnax'] = None; sys.argv = ['ppo.py', '--run-dir', 'run'];"
        f"import runpy; runpy.run_path({str(ROOT / 'experiments' / 'ppo.py')!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    install = "in this checkout, .venv/bin/pip install -c requirements/constraints.txt -e '.[rl]'"
    assert result.returncode == 2
    assert result.stderr.strip() == f"ppo.py: error: ppo needs the gymnax package, which is not installed: {install}"


@pytest.mark.slow
def test_a_population_member_is_its_own_separate_run_to_the_bit(tmp_path):
    """--population 2 trains seeds 0 and 1 as one program; under --deterministic-reduction each member's numbers
    are those of the run with its seed alone, bit for bit (without it, to float rounding, which a policy's
    sampled actions amplify within tens of steps)."""
    exact = [*TINY, "--deterministic-reduction", "--micro-batches", "4"]
    assert run_ppo(tmp_path, *exact, "--population", "2", "--run-dir", "both").returncode == 0
    together = records(tmp_path / "both")
    for seed in (0, 1):
        assert run_ppo(tmp_path, *exact, "--seed", str(seed), "--run-dir", f"seed{seed}").returncode == 0
        alone = records(tmp_path / f"seed{seed}")
        assert [r["step"] for r in alone] == [r["step"] for r in together]
        for a, b in zip(alone, together, strict=True):
            assert {k: v for k, v in a.items() if k != "step"} == {
                k: b[k.replace("/", "/member_", 1)][seed] for k in a if k != "step"
            }


@pytest.mark.slow
def test_a_sigterm_mid_run_resumes_to_the_bits_of_a_run_never_stopped(tmp_path):
    """The environments live in the train state: a resumed run continues every episode where it stopped."""
    args = [*TINY, "--env-steps", "40960", "--log-every", "4", "--eval-every", "80", "--checkpoint-minutes", "0"]
    assert run_ppo(tmp_path, *args, "--run-dir", "straight").returncode == 0
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "experiments" / "ppo.py"), *args, "--run-dir", "stopped"],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or logged nothing in time"
        time.sleep(0.005)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143 and "stopped by SIGTERM at step" in err, err
    resumed = run_ppo(tmp_path, *args, "--run-dir", "stopped", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert records(tmp_path / "stopped") == records(tmp_path / "straight")
    last = [RunDir(tmp_path / name).checkpoint_paths()[-1] for name in ("stopped", "straight")]
    assert checkpoint_digest(last[0]) == checkpoint_digest(last[1])


@pytest.mark.slow
def test_it_learns_cartpole_and_scripts_rollout_plays_the_evaluated_episodes(tmp_path):
    """100,000 environment steps take the greedy policy's return far above the initial one's; scripts/rollout
    replays the evaluation's episodes (their seed) to the same mean return."""
    short = ["--env-steps", "100000", "--eval-episodes", "16", "--no-progress"]
    assert run_ppo(tmp_path, *short, "--run-dir", "run").returncode == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    first = next(r for r in RunDir(tmp_path / "run").read_metrics() if "test/return" in r)
    untrained, _ = ppo.play_episodes(
        ppo.build_agent(ppo.Config.from_options(), jax.random.key(0)).model, "CartPole-v1", 16
    )
    assert summary["test_return"] > 150 > 4 * float(np.mean(untrained)), (summary, untrained)
    assert first["step"] == 100 and summary["last_100_return"] is not None
    played = subprocess.run(
        [
            str(ROOT / "scripts" / "rollout"),
            str(tmp_path / "run"),
            "--episodes",
            "16",
            "--seed",
            str(ppo.EVALUATION_KEY),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert played.returncode == 0, played.stderr
    assert played.stdout.startswith(f"CartPole-v1: return {summary['test_return']:.2f} ")
