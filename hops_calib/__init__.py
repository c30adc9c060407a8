"""hops-calib: calibrate and validate a pipeline-parallel training simulator against real Megatron-LM traces."""

__version__ = "0.1.0"
