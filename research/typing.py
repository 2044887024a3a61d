"""Shape aliases and the one `typecheck` decorator used on every public function.

`typecheck` is `jaxtyping.jaxtyped(typechecker=beartype)`: it checks shapes and dtypes when a
function is called with concrete or traced arrays, so under `jax.jit` the check happens once per
trace and compiled code pays nothing. Put it *below* `jax.jit` / `eqx.filter_jit`.
"""

import functools
import operator
import re
from collections.abc import Callable
from typing import TypeVar

from beartype import beartype
from jaxtyping import (
    Array,
    Bool,
    Float,
    Int,
    Integer,
    Key,
    PRNGKeyArray,
    PyTree,
    Scalar,
    Shaped,
    TypeCheckError,
    UInt32,
    jaxtyped,
)

__all__ = [
    "Array",
    "Bool",
    "Float",
    "Int",
    "Integer",
    "KeyData",
    "RowKeys",
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
# One key a row of a batch: what a loss gets (`research.train.GlobalBatch.value_and_grad`); raw key data
# (`jax.random.PRNGKey`'s) has a trailing axis.
RowKeys = Key[Array, " batch"] | UInt32[Array, "batch _"]


_SELF_SIZE = re.compile(r"\{self\.([A-Za-z_][A-Za-z0-9_.]*)\}")


def typecheck(fn: _F) -> _F:
    """Check `fn`'s jaxtyping annotations with beartype at every call (i.e. once per trace under jit).

    A method annotated with sizes of its module (`Float[Array, " {self.length}"]`) gets, on a failed
    check, a note with their values (`self.length = 40`): jaxtyping's own message shows `self` as
    `Module(...)`, so it names the expected dimension but not its size.
    """
    checked = jaxtyped(typechecker=beartype)(fn)
    sizes = sorted(set(_SELF_SIZE.findall(repr(getattr(fn, "__annotations__", {})))))
    if not sizes:
        return checked

    @functools.wraps(fn)
    def with_sizes(self, *args, **kwargs):
        try:
            return checked(self, *args, **kwargs)
        except TypeCheckError as error:
            values = []
            for name in sizes:
                try:
                    values.append(f"self.{name} = {operator.attrgetter(name)(self)!r}")
                except Exception:  # a broken property must not hide the real error
                    pass
            error.add_note(f"where {type(self).__name__} has " + ", ".join(values))
            raise

    return with_sizes  # type: ignore[return-value]
