"""Numerical kernels of the model, each beside its pure-PyTorch reference."""
