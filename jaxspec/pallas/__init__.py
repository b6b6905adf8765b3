"""Kernels. One op per module: Pallas kernel, jitted wrapper, pure-jnp reference, dispatch."""
