"""Ops: each is kernels.py (@triton.jit) -> launch.py -> function.py (custom_op + autograd) -> public wrapper."""
