"""The three classic state-passing exercises, on `research.state`, jitted and printed step by step.

JAX functions are pure: instead of mutating an object, each step takes the state in and gives a new
state back, `(state, input) -> (new_state, output)`. The same function then runs in a Python loop
(one jitted call per step, printed below) or as the body of `jax.lax.scan` (one compiled loop).

1. A counter updated 5 times: counts 1..5; each update returns the count before it, 0..4.
2. A running mean of [2, 4, 6, 8, 10]: means 2, 3, 4, 5, 6.
3. Gradient descent on f(x) = x^2 from x = 5 with learning rate 0.1: x <- x - 0.1 * 2x, so
   4.0, 3.2, 2.56, 2.048, 1.6384.

Run `./scripts/run state_passing` (`--help` for the options).
"""

import argparse
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from research.state import Counter, RunningMean
from research.typing import Array, Float, Int, typecheck


# -- 1. counter ------------------------------------------------------------------------------
@jax.jit
@typecheck
def count_step(counter: Counter) -> tuple[Counter, Int[Array, ""]]:
    """One increment: the new counter and the count before it."""
    return counter.update()


def count(times: int) -> tuple[list[int], list[int]]:
    """`(counts after each update, values the updates returned)`: (1..times, 0..times-1)."""
    counter, counts, returned = Counter.init(), [], []
    for _ in range(times):
        counter, before = count_step(counter)
        counts.append(int(counter.count))
        returned.append(int(before))
    return counts, returned


# -- 2. running mean -------------------------------------------------------------------------
@jax.jit
@typecheck
def mean_step(mean: RunningMean, value: Float[Array, ""]) -> tuple[RunningMean, Float[Array, ""]]:
    """Fold one value into the running (sum, count); returns the new state and the mean so far."""
    return mean.update(value)


def running_means(values: Sequence[float]) -> list[float]:
    mean, means = RunningMean.init(0.0), []
    for value in values:
        mean, current = mean_step(mean, jnp.asarray(value, jnp.float32))
        means.append(float(current))
    return means


# -- 3. gradient descent ---------------------------------------------------------------------
class Descent(eqx.Module):
    """Gradient-descent state: the parameter and how many steps were taken."""

    x: Float[Array, ""]
    steps: Counter


def loss(x: Float[Array, ""]) -> Float[Array, ""]:
    return x**2


@jax.jit
@typecheck
def descent_step(state: Descent, lr: Float[Array, ""]) -> tuple[Descent, Float[Array, ""]]:
    """`x <- x - lr * f'(x)`; returns the new state and the new x."""
    x = state.x - lr * jax.grad(loss)(state.x)
    steps, _ = state.steps.update()
    return Descent(x, steps), x


def gradient_descent(start: float, lr: float, steps: int) -> list[float]:
    state, xs = Descent(jnp.asarray(start, jnp.float32), Counter.init()), []
    for _ in range(steps):
        state, x = descent_step(state, jnp.asarray(lr, jnp.float32))
        xs.append(float(x))
    return xs


# -- the script ------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> dict[str, list]:
    parser = argparse.ArgumentParser(
        prog="state_passing",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=5, help="counter updates and gradient-descent steps")
    parser.add_argument(
        "--values",
        type=float,
        nargs="+",
        default=[2.0, 4.0, 6.0, 8.0, 10.0],
        help="the values whose running mean is printed",
    )
    parser.add_argument("--start", type=float, default=5.0, help="starting x of gradient descent on x^2")
    parser.add_argument("--lr", type=float, default=0.1, help="gradient-descent learning rate")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be positive (got {args.steps})")

    counts, returned = count(args.steps)
    print(f"1. counter, {args.steps} updates: (state, ()) -> (state + 1, state)")
    for i, (c, r) in enumerate(zip(counts, returned, strict=True), 1):
        print(f"   update {i}: count {c}, returned {r}")
    scanned = jax.lax.scan(Counter.update, Counter.init(), jnp.ones(args.steps, jnp.int32))[1]
    print(f"   as a lax.scan body: returned {scanned.tolist()}")

    means = running_means(args.values)
    print(f"2. running mean of {args.values}: (sum, count), value -> (sum + value, count + 1), mean")
    for i, (v, m) in enumerate(zip(args.values, means, strict=True), 1):
        print(f"   value {i}: {v:g} -> mean {m:g}")
    scanned = jax.lax.scan(RunningMean.update, RunningMean.init(0.0), jnp.asarray(args.values, jnp.float32))[1]
    print(f"   as a lax.scan body: means {scanned.tolist()}")

    xs = gradient_descent(args.start, args.lr, args.steps)
    print(f"3. gradient descent on x^2 from x = {args.start:g}, lr {args.lr:g}: x -> x - lr * 2x")
    for i, x in enumerate(xs, 1):
        print(f"   step {i}: x = {x:.6g}, loss {x * x:.6g}")
    return {"counts": counts, "returned": returned, "means": means, "xs": xs}


if __name__ == "__main__":
    main()
