"""Mixed precision: a loss computed in a lower float type (`LowPrecision`, `InPrecision`) and the
`Precision` a run names (`--precision`)."""

from ._precision import InPrecision, LowPrecision, Precision

__all__ = ["InPrecision", "LowPrecision", "Precision"]
