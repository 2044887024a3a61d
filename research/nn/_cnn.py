import equinox as eqx
import jax
import jax.numpy as jnp

from ..typing import Array, Float, PRNGKeyArray, typecheck
from ._conv import conv1d_as_matmul

# (kernel, stride, padding) of the three convolutions of MNIST-1D's reference `ConvBase`.
_LAYERS = ((5, 2, 1), (3, 2, 1), (3, 2, 1))


def conv_output_length(length: int, kernel: int, stride: int, padding: int) -> int:
    return (length + 2 * padding - kernel) // stride + 1


class CNN1d(eqx.Module):
    """MNIST-1D's reference convolutional network (`ConvBase` in Greydanus's `mnist1d`).

    Conv1d(1->c, kernel 5, stride 2, padding 1), Conv1d(c->c, 3, 2, 1), Conv1d(c->c, 3, 2, 1), each
    followed by ReLU, then flatten (channel-major, as `torch.view`) and one linear layer. With the
    defaults (length 40, 25 channels, 10 classes) the lengths go 40 -> 19 -> 10 -> 5 and it has
    5,210 parameters. Equinox initialises Conv and Linear like PyTorch (uniform +-1/sqrt(fan_in)).

    **Arguments:**

    - `length`: length of the input signal.
    - `classes`: number of classes.
    - `channels`: channels of every convolution.
    - `key`: initialisation key.
    """

    convs: tuple[eqx.nn.Conv1d, ...]
    head: eqx.nn.Linear
    length: int = eqx.field(static=True)
    classes: int = eqx.field(static=True)
    channels: int = eqx.field(static=True)

    def __init__(self, length: int = 40, classes: int = 10, channels: int = 25, *, key: PRNGKeyArray):
        keys = jax.random.split(key, len(_LAYERS) + 1)
        convs, in_channels, out_length = [], 1, length
        for (kernel, stride, padding), k in zip(_LAYERS, keys[:-1], strict=True):
            convs.append(eqx.nn.Conv1d(in_channels, channels, kernel, stride=stride, padding=padding, key=k))
            in_channels, out_length = channels, conv_output_length(out_length, kernel, stride, padding)
        if out_length < 1:
            raise ValueError(f"CNN1d needs a longer signal: length {length} leaves nothing after the convolutions")
        self.convs = tuple(convs)
        self.head = eqx.nn.Linear(channels * out_length, classes, key=keys[-1])
        self.length, self.classes, self.channels = length, classes, channels

    def __check_init__(self):
        out_length = self.length
        for kernel, stride, padding in _LAYERS:
            out_length = conv_output_length(out_length, kernel, stride, padding)
        if self.head.weight.shape != (self.classes, self.channels * out_length):
            raise ValueError(
                f"CNN1d head should be {(self.classes, self.channels * out_length)} for length {self.length}, "
                f"got {self.head.weight.shape}"
            )

    @typecheck
    def __call__(
        self, x: Float[Array, " {self.length}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " {self.classes}"]:
        h = x[None, :]  # one input channel
        for conv in self.convs:
            # The same function as conv(h), as patches @ weight: XLA's CPU convolution is several
            # times slower, and much slower still inside a compiled multi-step loop.
            h = jax.nn.relu(conv1d_as_matmul(conv, h))
        return self.head(jnp.ravel(h))
