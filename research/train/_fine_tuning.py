"""Fine-tuning options (`research.config.FineTuning`: `--trainable`, `--lora-rank`, `--lora-targets`,
`--lora-alpha`) applied to a model: LoRA adapters put on it (`with_adapters`), the pattern of the parameters
that train (`trained_pattern`, for `only_trainable` and `Frozen`), and the options checked against the model
before any work (`check_fine_tuning`), each problem refused in one line. Experiments that fine-tune (lm,
images) share them."""

import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError
from ..nn import LoRA, linear_layers
from ..typing import PRNGKeyArray
from ._frozen import check_trainable, trainable_pattern

ADAPTERS = r"^adapters\."  # what trains of a `LoRA`: its adapters, not its `model`


@runtime_checkable
class FineTuningOptions(Protocol):
    """What these functions read of `research.config.FineTuning` (or of any object with these attributes)."""

    @property
    def trainable(self) -> str: ...
    @property
    def lora_rank(self) -> int: ...
    @property
    def lora_targets(self) -> str: ...
    @property
    def lora_alpha(self) -> float: ...


def trained_pattern(options: FineTuningOptions, new: Sequence[str] = ()) -> str:
    """What trains, as a regular expression searched in the parameters' names ("": everything): LoRA's
    adapters alone with `--lora-rank`, else `--trainable`'s. `new`: the names of layers made afresh (a
    classifier's head for other classes than the pretrained model's), which train whatever the options say."""
    if options.lora_rank:
        return "|".join([ADAPTERS, *(rf"^model\.{re.escape(name)}\." for name in new)])
    pattern = trainable_pattern(options.trainable)
    if not pattern or not new:
        return pattern
    return "|".join([f"(?:{pattern})", *(rf"^{re.escape(name)}\." for name in new)])


def check_fine_tuning(model: Any, options: FineTuningOptions) -> None:
    """Refuse (`ConfigError`, one line) options that cannot work on `model` (its arrays, or their shapes from
    `eqx.filter_eval_shape`): `--trainable` beside `--lora-rank`, a `--lora-targets` that is no regular
    expression or finds no linear layer, a rank above a chosen layer's inputs or outputs (a full-rank update),
    a `--trainable` that finds no parameter."""
    if options.lora_rank:
        if options.trainable != "all":
            raise ConfigError(f"--lora-rank trains its adapters alone: drop --trainable {options.trainable}")
        try:
            chosen = {name: x for name, x in linear_layers(model).items() if re.search(options.lora_targets, name)}
        except re.error as e:
            raise ConfigError(f"--lora-targets {options.lora_targets!r} is not a regular expression: {e}") from None
        if not chosen:
            names = ", ".join(linear_layers(model))
            raise ConfigError(f"--lora-targets {options.lora_targets!r} finds no linear layer (they are: {names})")
        name, smallest = min(((n, min(x.weight.shape[-2:])) for n, x in chosen.items()), key=lambda item: item[1])
        if options.lora_rank > smallest:
            raise ConfigError(
                f"--lora-rank {options.lora_rank} is above the {smallest} inputs or outputs of {name}: "
                "a low-rank update is smaller"
            )
    elif pattern := trainable_pattern(options.trainable):
        check_trainable(model, pattern, options.trainable)


def with_adapters(model: Any, options: FineTuningOptions, *, key: PRNGKeyArray) -> Any:
    """`model` with LoRA adapters on the linear layers `--lora-targets` finds (`research.nn.LoRA`, which starts
    as `model` to the bit), or `model` itself without `--lora-rank`."""
    if not options.lora_rank:
        return model
    return LoRA(model, options.lora_rank, options.lora_targets, options.lora_alpha, key=key)
