"""Attention kernels (Pallas on GPU) and the pure-JAX references they match."""
