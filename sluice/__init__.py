"""Sluice: asynchronous inference for PyTorch models on AWS."""

__version__ = "0.1.0"
