"""The physical layouts the compiled step holds its arrays in, where XLA's own choice costs memory.

XLA's GPU layout assignment gives a loop's arrays the layout their matmuls like best, and makes
whatever enters or leaves the loop in another layout a copy. Two such copies held whole arrays on
the devices: each microbatch's gradient sums kept transposed and copied out after the loop, and
the stacked weights a dot reads transposed copied before it (both the MLP's down projection and
attention's output projection). Held row-major, the layout the step's inputs and outputs have,
the transposition happens on each layer's slice inside the loop, fused into the add or the
weight's gather, with no buffer of the whole stack (docs/memory.md)."""

import jax
from jax.experimental.layout import Layout, with_layout_constraint


def row_major(tree):
  """`tree`'s arrays (of two or more dimensions) held row-major where they are computed."""
  return jax.tree.map(lambda a: with_layout_constraint(a, Layout(tuple(range(a.ndim))))
                      if a.ndim > 1 else a, tree)
