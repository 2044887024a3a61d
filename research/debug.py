"""JAX's sharp bits made visible: why a jitted function traced again, and where a NaN came from.

- **Retraces.** `jax.jit` compiles once per *abstract signature* of its arguments (shapes, dtypes,
  weak types, static values). A signature that changes between calls recompiles silently, the usual
  cause of a run that is mysteriously slow. `RetraceLog` records each trace's signature and, on the
  first retrace, logs which argument changed and how. `explain_retraces` puts it on any function.
- **NaNs.** With `jax_debug_nans` on, a jitted call whose output holds a NaN is re-run op by op and
  raises `FloatingPointError` at the first primitive that produced one (`fit` also replays op by op,
  with `jax_debug_infs` too, a step whose loss or gradient went non-finite without reaching an
  output). `describe_nan_error` turns that error into one line naming the primitive and the source
  line that called it.
"""

import functools
import inspect
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

logger = logging.getLogger("research")

F = TypeVar("F", bound=Callable)

Signature = dict[str, str]


def describe(value: Any) -> str:
    """`float32[128,2]` for an array or tracer (`~float32[]` when weakly typed), `static 3` otherwise."""
    if isinstance(value, jax.Array):  # tracers are jax.Arrays too
        return str(jax.typeof(value))
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}".replace(" ", "")
    text = repr(value)
    return f"static {text if len(text) <= 60 else text[:57] + '...'}"


def signature(arguments: dict[str, Any]) -> Signature:
    """The abstract signature of named arguments: one entry per leaf, keyed `name.path[0]...`."""
    flat: Signature = {}
    for name, tree in arguments.items():
        leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
        if not leaves:
            flat[name] = "static (empty)"
        for path, leaf in leaves:
            flat[name + jax.tree_util.keystr(path)] = describe(leaf)
    return flat


def signature_changes(before: Signature, after: Signature) -> list[str]:
    """What differs between two signatures, one phrase per argument leaf."""
    changes = []
    for key in sorted(set(before) | set(after), key=lambda k: (k not in before, k)):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if old is None:
            changes.append(f"{key} appeared ({new})")
        elif new is None:
            changes.append(f"{key} disappeared (was {old})")
        else:
            changes.append(f"{key}: {old} -> {new}")
    return changes


class RetraceLog:
    """Signatures of the traces of named functions; logs (once per function) what a retrace changed.

    Call `record(name, arguments)` from inside the traced function: it runs once per trace.
    """

    def __init__(self) -> None:
        self.signatures: dict[str, list[Signature]] = {}
        self.explanations: dict[str, str] = {}

    def record(self, name: str, arguments: dict[str, Any]) -> str | None:
        """Store this trace's signature; on the first retrace of `name`, log and return why it happened."""
        traces = self.signatures.setdefault(name, [])
        traces.append(signature(arguments))
        if len(traces) < 2 or name in self.explanations:
            return None
        changes = signature_changes(traces[-2], traces[-1]) or [
            "no argument changed (a new Python function or closure, or jax.config changed)"
        ]
        shown = changes[:8] + ([f"... and {len(changes) - 8} more"] if len(changes) > 8 else [])
        message = f"{name} traced again (trace {len(traces)}), which recompiles; changed: " + "; ".join(shown)
        self.explanations[name] = message
        logger.warning(message)
        return message


retrace_log = RetraceLog()


def explain_retraces(name: str | None = None, log: RetraceLog = retrace_log) -> Callable[[F], F]:
    """Decorate the function that `jax.jit`/`eqx.filter_jit` compiles (put it *below* the jit):
    each trace records its arguments' signature, and the first retrace logs what changed.

    ```python
    @eqx.filter_jit
    @explain_retraces()
    def step(model, batch): ...
    ```
    """

    def wrap(fn: F) -> F:
        label = name or getattr(fn, "__qualname__", repr(fn))
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            log.record(label, dict(bound.arguments))
            return fn(*args, **kwargs)

        return traced  # type: ignore[return-value]

    return wrap


_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # research/ lives here
_JAX_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, __import__("jaxlib")) if m.__file__)


def _short_path(filename: str) -> str:
    """Relative to the working directory when inside it, else to the `sys.path` entry holding it
    (`optax/losses/_classification.py`), else absolute."""
    path = os.path.abspath(filename)
    relative = os.path.relpath(path)
    if not relative.startswith(".."):
        return relative
    candidates = [*sys.path, _REPOSITORY]
    roots = [os.path.abspath(p) + os.sep for p in candidates if p and path.startswith(os.path.abspath(p) + os.sep)]
    return path[len(max(roots, key=len)) :] if roots else path


def describe_nan_error(error: FloatingPointError, during: str | None = None) -> str:
    """One line from the error `jax_debug_nans` raises: the primitive, the calling source line, and
    `during` (say `"training step 7"`)."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    match = re.search(r"invalid value \((nan|inf)\) encountered in (\S+)", first_line)
    op = f"`{match.group(2)}`" if match else "an operation"
    what = {"nan": "NaN", "inf": "Inf"}[match.group(1)] if match else "NaN"
    where = ""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_JAX_DIRS)]
    if frames:
        frame = frames[-1]
        source = f" (`{frame.line.strip()}`)" if frame.line else ""
        where = f" at {_short_path(frame.filename)}:{frame.lineno} in {frame.name}{source}"
    backward = " in the backward pass" if "differentiating" in str(error) else ""
    when = f" during {during}" if during else ""
    return f"{what} first produced by {op}{backward}{where}{when} (found with --debug-nans)"
