"""A hook through which `research.per_example` sees the linear maps inside a model (ghost clipping).

A layer that computes `outputs = inputs @ weight.T` row by row (one row per position: one for a
dense layer, one per output position for a convolution as patches @ weight) passes its rows through
`observed_linear_map(layer, inputs, outputs)` and continues with what it returns. Outside
`observing_linear_maps` that is `outputs` itself: nothing is added to the traced program. Inside
`observing_linear_maps(observer)` it is `observer(layer, inputs, outputs)`, which may keep the inputs
and add a (zero) perturbation to the outputs, whose gradient is then the gradient of the outputs. From
those two, per-example gradient norms follow without any per-example gradient
(`research.per_example`, `method="ghost"`).

The observer is a trace-time hook (a context variable, set only while a function is traced): it is
never part of a model, a pytree or compiled code.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from ..typing import Array, Float

# observer(layer, inputs [positions, in], outputs [positions, out]) -> outputs [positions, out]
LinearMapObserver = Callable[[object, Array, Array], Array]

_OBSERVER: contextvars.ContextVar[LinearMapObserver | None] = contextvars.ContextVar(
    "linear_map_observer", default=None
)


@contextlib.contextmanager
def observing_linear_maps(observer: LinearMapObserver) -> Iterator[None]:
    """While tracing inside this block, every `observed_linear_map` call goes through `observer`."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def observed_linear_map(
    layer: object, inputs: Float[Array, "positions features_in"], outputs: Float[Array, "positions features_out"]
) -> Float[Array, "positions features_out"]:
    """`outputs`, or what the active observer makes of them: called by a layer (identified by its
    `weight` array) on the rows of `outputs = inputs @ layer.weight.reshape(out, -1).T`, before any bias."""
    observer = _OBSERVER.get()
    return outputs if observer is None else observer(layer, inputs, outputs)
