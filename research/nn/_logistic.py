import equinox as eqx

from ..typing import Array, Float, PRNGKeyArray, typecheck


class Logistic(eqx.Module):
    """Multinomial logistic regression: one linear map from the signal to class logits.

    **Arguments:**

    - `length`: length of the input signal (40 for MNIST-1D).
    - `classes`: number of classes.
    - `key`: initialisation key.
    """

    linear: eqx.nn.Linear
    length: int = eqx.field(static=True)
    classes: int = eqx.field(static=True)

    def __init__(self, length: int = 40, classes: int = 10, *, key: PRNGKeyArray):
        self.linear = eqx.nn.Linear(length, classes, key=key)
        self.length = length
        self.classes = classes

    def __check_init__(self):
        if self.linear.weight.shape != (self.classes, self.length):
            raise ValueError(f"Logistic weight should be {(self.classes, self.length)}, got {self.linear.weight.shape}")

    @typecheck
    def __call__(
        self, x: Float[Array, " {self.length}"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " {self.classes}"]:
        return self.linear(x)
