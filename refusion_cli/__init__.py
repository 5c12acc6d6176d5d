"""ReFusion toolkit: slot-level plan-and-infill decoding, training, evaluation and speed benchmarks."""

__version__ = "0.1.0"
