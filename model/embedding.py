"""The embedding lookup: each token's row of the table; its backward adds up every token's gradient
into its row, per device (sharding.per_shard), and moves the sums between devices itself.

  table[V_tensor, D_(fsdp,sequence)], tokens[B_(data,fsdp), L_sequence] → x[B, L, D] (as tokens)

Left to XLA, that scatter-add replicates the fp32 [B, L, D] gradient on every device wherever the
tokens and the table's model dimension are split over different axes (fsdp × sequence,
data × fsdp × tensor: its "Involuntary full rematerialization"). Here each device instead does
the cheaper of:
  - exchange: an all-to-all over the axes that split D, in the gradient's dtype, hands every
    device all its group's tokens for its own slice of D (and their ids, all-gathered), which it
    adds up into its shard of the table: T·(D·c + 4) bytes for T tokens a device;
  - reduce-scatter: it adds up its own tokens into its whole [V/t, D] and reduce-scatters that in
    the table's dtype: (V/t)·D·r bytes.
Both send (n − 1)/n of that over n devices, so the exchange wins unless a device has more than
about V/t·r/c tokens (256,000 for Llama 3's vocabulary with fp32 reductions of bf16; the 8b
preset has 32,768 a device). Rows of another device's vocabulary shard (`tensor`) are dropped;
the sum over the remaining token axes (`data`) is an all-reduce, which XLA merges with a tied
head's.
"""

import functools

import flax.core.spmd
import jax
import jax.numpy as jnp
from flax import nnx

import sharding

TOKENS = ('batch', 'length')
TABLE = ('vocab', 'embed')


def lookup(table_VD, table_c_VD, tokens_BL):
  """The tokens' rows of table_c (the table in the compute dtype, gathered); the gradient goes to
  `table_VD`, in its dtype (the one gradients are reduced across devices in) and sharding."""
  # The backward is traced after the forward returns, outside the caller's rules: it gets them.
  return _lookup(tuple(flax.core.spmd.get_logical_axis_rules()), table_VD, table_c_VD, tokens_BL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(rules, table_VD, table_c_VD, tokens_BL):
  del rules, table_VD
  return take(table_c_VD, tokens_BL)


def take(table_c_VD, tokens_BL):
  """The tokens' rows of table_c. With the vocabulary split (over `tensor`), each device takes
  those in its own shard and the shards' results are summed, exactly (one is not zero): the
  gather is not left to XLA's partitioner, whose jax 0.12 release aborts on it inside a pipeline
  stage (a CHECK in ExpandDeviceGroupsWithIota)."""
  vocab_axis = sharding.mesh_axis('vocab')
  if vocab_axis is None:
    return jnp.take(table_c_VD, tokens_BL, axis=0)

  def local(table_VD, tokens_BL):
    rows = table_VD.shape[0]
    row_BL = tokens_BL - jax.lax.axis_index(vocab_axis) * rows
    here_BL = (row_BL >= 0) & (row_BL < rows)
    x_BLD = jnp.take(table_VD, jnp.where(here_BL, row_BL, 0), axis=0)
    return jax.lax.psum(jnp.where(here_BL[..., None], x_BLD, 0), vocab_axis)

  return sharding.per_shard(local, (TABLE, TOKENS), TOKENS + ('embed',))(table_c_VD, tokens_BL)


def _lookup_fwd(rules, table_VD, table_c_VD, tokens_BL):
  return _lookup(rules, table_VD, table_c_VD, tokens_BL), (table_VD, tokens_BL)


def _lookup_bwd(rules, residuals, g_BLD):
  with nnx.logical_axis_rules(rules):
    return table_grad(*residuals, g_BLD), None, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def table_grad(table_VD, tokens_BL, g_BLD):
  """The gradient of the table for the tokens' gradients g_BLD, as the module docstring says."""
  token_axes, scatter, summed = sharding.token_gradient_axes('the embedding')
  vocab_axis = sharding.mesh_axis('vocab')
  V, D = table_VD.shape
  rows = V // sharding.axes_size([vocab_axis] if vocab_axis else [])
  tokens = tokens_BL.size // sharding.axes_size(token_axes)
  exchange = tokens * (D * g_BLD.dtype.itemsize + 4) < rows * D * table_VD.dtype.itemsize

  def local(tokens_BL, g_BLD):
    ids_T, g_TD = tokens_BL.reshape(-1), g_BLD.reshape(tokens_BL.size, D)
    if scatter and exchange:
      g_TD = jax.lax.all_to_all(g_TD, scatter, split_axis=1, concat_axis=0, tiled=True)
      ids_T = jax.lax.all_gather(ids_T, scatter, tiled=True)
    row_T = ids_T - (jax.lax.axis_index(vocab_axis) * rows if vocab_axis else 0)
    row_T = jnp.where((row_T >= 0) & (row_T < rows), row_T, rows)  # another shard's: dropped
    # fp32 sums: a frequent token has thousands of terms.
    d_VD = jnp.zeros((rows, g_TD.shape[1]), jnp.float32).at[row_T].add(
        g_TD.astype(jnp.float32), mode='drop').astype(table_VD.dtype)
    if scatter and not exchange:
      d_VD = jax.lax.psum_scatter(d_VD, scatter, scatter_dimension=1, tiled=True)
    return jax.lax.psum(d_VD, summed) if summed else d_VD

  d_VD = sharding.per_shard(local, (TOKENS, TOKENS + ('embed',)),
                            sharding.Params(TABLE))(tokens_BL, g_BLD)
  return sharding.varying_like(d_VD, table_VD)
