"""Shape aliases and the one `typecheck` decorator used on every public function.

`typecheck` is `jaxtyping.jaxtyped(typechecker=beartype)`: it checks shapes and dtypes when a
function is called with concrete or traced arrays, so under `jax.jit` the check happens once per
trace and compiled code pays nothing. Put it *below* `jax.jit` / `eqx.filter_jit`.
"""

from collections.abc import Callable
from typing import TypeVar

from beartype import beartype
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree, Scalar, Shaped, UInt32, jaxtyped

__all__ = [
    "Array",
    "Bool",
    "Float",
    "Int",
    "KeyData",
    "PRNGKeyArray",
    "PyTree",
    "Scalar",
    "Shaped",
    "UInt32",
    "typecheck",
]

_F = TypeVar("_F", bound=Callable)

# A PRNG key stored as raw `uint32` data, the form that `eqx.tree_serialise_leaves` can write.
KeyData = UInt32[Array, "2"]


def typecheck(fn: _F) -> _F:
    """Check `fn`'s jaxtyping annotations with beartype at every call (i.e. once per trace under jit)."""
    return jaxtyped(typechecker=beartype)(fn)

