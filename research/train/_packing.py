"""A small TrainState's leaves carried between compiled calls as one buffer.

Every array passed into or out of a compiled call costs dispatch time (~1.5 us on this CPU, in and
out), which is most of a step when the model is tiny: the XOR MLP's TrainState has six leaves. Here
all 32-bit leaves (float32, int32, uint32) travel bitcast into one `uint32` vector; leaves of other
dtypes travel as they are. The compiled functions unpack the vector on entry and pack it on exit,
so what runs in between, a `fori_loop` of train steps included, sees the same leaves as before.

The step statistics (`_stats.py:StepStats`) are one such buffer too: their float sums and integer
counters are the leaves of a `Packing`, so one vector goes in and out of each compiled call.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

Leaves = list[jax.Array]

# States with more elements than this are not packed: their steps take long enough that dispatch
# does not matter, and the copy into one buffer would (the ResNet1d's ~230k elements are not packed).
PACK_LIMIT = 1 << 16
_WORD = np.dtype(np.uint32)
Specs = tuple[tuple[tuple[int, ...], np.dtype], ...]


def _in_buffer(dtype) -> bool:
    """32-bit leaves (float32, int32, uint32) go into the buffer, bitcast to `uint32`."""
    return np.dtype(dtype).itemsize == _WORD.itemsize


def describe_spec(spec: tuple[tuple[int, ...], np.dtype]) -> str:
    """`float32[8, 2]`: a leaf's dtype and shape, for messages."""
    shape, dtype = spec
    return f"{dtype.name}{list(shape)}"


@dataclasses.dataclass(frozen=True)
class Packing:
    """Which leaves (by shape and dtype) share the buffer, and in what order; hashable."""

    specs: Specs

    @property
    def size(self) -> int:
        """The buffer's length in words."""
        return sum(math.prod(shape) for shape, dtype in self.specs if _in_buffer(dtype))

    def holds(self, dtype) -> np.ndarray:
        """For each word of the buffer, whether it holds (a bitcast element of) a leaf of `dtype`."""
        return np.concatenate(
            [
                np.full(math.prod(shape), np.dtype(kind) == np.dtype(dtype))
                for shape, kind in self.specs
                if _in_buffer(kind)
            ]
        )

    @staticmethod
    def specs_of(leaves: Leaves) -> Specs:
        return tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)

    @staticmethod
    def of(leaves: Leaves) -> "Packing | None":
        """The packing of these leaves, or None when packing would not pay (a big state, or fewer
        than two 32-bit leaves)."""
        specs = Packing.specs_of(leaves)
        too_big = sum(math.prod(shape) for shape, _ in specs) > PACK_LIMIT
        if too_big or sum(_in_buffer(dtype) for _, dtype in specs) < 2:
            return None
        return Packing(specs)

    def pack(self, leaves: Leaves) -> Leaves:
        """`[buffer, *other leaves]` of leaves with `specs`; traceable, and runs as is on concrete arrays."""
        words = [
            jax.lax.bitcast_convert_type(x, _WORD).ravel() if x.dtype != _WORD else x.ravel()
            for x in leaves
            if _in_buffer(x.dtype)
        ]
        return [jnp.concatenate(words), *(x for x in leaves if not _in_buffer(x.dtype))]

    def unpack(self, packed: Leaves) -> Leaves:
        """The leaves of `pack(leaves)`, in their order."""

        def leaf(words, dtype):
            return words if dtype == _WORD else jax.lax.bitcast_convert_type(words, dtype)

        return self._split(packed[0], packed[1:], leaf)

    def _split(self, buffer, others: list, leaf) -> list:
        """Each leaf in order: `leaf(words, dtype)` of its `[shape]` slice of `buffer`, or the next of `others`."""
        rest, leaves, start = iter(others), [], 0
        for shape, dtype in self.specs:
            if not _in_buffer(dtype):
                leaves.append(next(rest))
                continue
            size = math.prod(shape)
            leaves.append(leaf(buffer[start : start + size].reshape(shape), dtype))
            start += size
        return leaves

    def buffer_on_host(self, leaves: list) -> np.ndarray:
        """The buffer of `pack(leaves)` for concrete arrays (jax, numpy, numpy scalars), made in numpy: no
        transfer, no device op."""
        return np.concatenate([np.asarray(x).view(_WORD).ravel() for x in leaves if _in_buffer(x.dtype)])

    def pack_on_host(self, leaves: Leaves) -> Leaves:
        """`pack` of concrete arrays, done in numpy with one transfer back."""
        # device_put, not jnp.asarray: an upload, where jnp.asarray compiles a program for each shape
        return [jax.device_put(self.buffer_on_host(leaves)), *(x for x in leaves if not _in_buffer(x.dtype))]

    def unpack_on_host(self, packed: Leaves) -> Leaves:
        """`unpack` of concrete arrays, done in numpy; the leaves are copies (a view would keep the
        packed buffer referenced, and it is donated by the next step)."""

        def leaf(words, dtype):
            return jax.device_put(words.view(dtype).copy())

        return self._split(np.asarray(packed[0]), packed[1:], leaf)

    def views_on_host(self, buffer: np.ndarray) -> list[np.ndarray]:
        """The leaves of a numpy buffer whose leaves are all 32-bit, as numpy views of it (no copy)."""
        return self._split(buffer, [], lambda words, dtype: words.view(dtype))
