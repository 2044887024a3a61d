"""Evaluation beyond the common evaluators `research.train` exports: evaluating a state (its EMA's weights
and its trained ones: `averaged_and_raw`) or a stream of batches by hand, combining evaluators, padding the
last batch, the check that data has the labels the default evaluators score, and the probes of a
representation (a linear probe and k-NN on frozen features) and of a language model."""

from ._evaluate import (
    averaged_and_raw,
    check_labelled,
    combined_evaluator,
    evaluate_batches,
    evaluate_state,
    mean_of_sums,
    padded_batches,
)
from ._language import evaluate_language_model
from ._probe import encoded, knn_accuracy, linear_probe_accuracy, probe_evaluator

__all__ = [
    "averaged_and_raw",
    "check_labelled",
    "combined_evaluator",
    "encoded",
    "evaluate_batches",
    "evaluate_language_model",
    "evaluate_state",
    "knn_accuracy",
    "linear_probe_accuracy",
    "mean_of_sums",
    "padded_batches",
    "probe_evaluator",
]
