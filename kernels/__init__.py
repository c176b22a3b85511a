"""Triton kernels for tokenmill, each with a plain-torch reference beside it."""
