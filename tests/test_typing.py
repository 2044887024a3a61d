import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jaxtyping import TypeCheckError

from research.typing import Array, Float, typecheck

ROOT = pathlib.Path(__file__).parent.parent


@typecheck
def pair_sum(x: Float[Array, "batch features"], y: Float[Array, "batch features"]) -> Float[Array, " batch"]:
    return jnp.sum(x + y, axis=1)


def test_matching_shapes_pass():
    assert pair_sum(jnp.ones((3, 2)), jnp.ones((3, 2))).shape == (3,)


def test_mismatched_dimension_is_named():
    with pytest.raises(TypeCheckError) as info:
        pair_sum(jnp.ones((3, 2)), jnp.ones((4, 2)))
    message = str(info.value)
    assert "batch" in message and "y" in message


def test_wrong_dtype_is_rejected():
    with pytest.raises(TypeCheckError):
        pair_sum(jnp.ones((3, 2), jnp.int32), jnp.ones((3, 2)))


def test_check_runs_once_per_trace_under_jit():
    calls = []

    @jax.jit
    @typecheck
    def double(x: Float[Array, " n"]) -> Float[Array, " n"]:
        calls.append(1)
        return 2 * x

    for _ in range(5):
        double(jnp.ones(4))
    assert len(calls) == 1
    with pytest.raises(TypeCheckError):
        double(jnp.ones((4, 1)))  # a new shape traces again, and is checked again


def test_no_future_annotations_anywhere():
    """`from __future__ import annotations` turns annotations into strings and the checks off."""
    for path in [*ROOT.glob("research/**/*.py"), *ROOT.glob("experiments/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                assert "annotations" not in [a.name for a in node.names], path
