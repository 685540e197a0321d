"""Rows to the devices that need them along one mesh axis, the sizes known only at run time: a
mixture-of-experts layer's tokens to their experts' devices and back. Run inside shard_map.

  exchange(x[R, D] in destination order, send[P], recv[P], out_rows) → y[out_rows, D]

Device i sends its send[j] rows from Σ_{j'<j} send[j'] to device j; y holds the rows received
from device s at Σ_{s'<s} recv[s'], in source order, zeros after the last. recv must be what the
other devices send. Either side's offsets may be given instead: rows sent from each offset, or
received to each.

Compiled for CUDA it is one `ragged-all-to-all`, which sends only the rows. XLA's CPU backend has
no ragged all-to-all, so elsewhere it is a padded `all-to-all`: every device sends every other a
buffer of `chunk` rows (the most one device can send another), P times the bytes at worst, with
the same result.
"""

import jax
import jax.numpy as jnp


def exclusive_cumsum(n, axis: int = 0):
  return jnp.cumsum(n, axis=axis) - n


def exchange(x_RD, send_P, recv_P, out_rows: int, axis: str, chunk: int, in_offsets_P=None,
             out_offsets_P=None):
  """The module docstring's exchange along mesh axis `axis`; `chunk` ≥ any send[j]."""
  in_offsets_P = exclusive_cumsum(send_P) if in_offsets_P is None else in_offsets_P
  out_offsets_P = exclusive_cumsum(recv_P) if out_offsets_P is None else out_offsets_P

  def ragged(x_RD, send_P, recv_P, in_offsets_P, out_offsets_P):
    # Each sender names where its rows land in the receiver's buffer: the receiver's offsets.
    there_P = jax.lax.all_to_all(out_offsets_P, axis, 0, 0, tiled=True)
    out_RD = jnp.zeros((out_rows, x_RD.shape[1]), x_RD.dtype)
    return jax.lax.ragged_all_to_all(x_RD, out_RD, in_offsets_P, send_P, there_P, recv_P,
                                     axis_name=axis)

  def padded(x_RD, send_P, recv_P, in_offsets_P, out_offsets_P):
    i_c = jnp.arange(chunk)
    rows_Pc = jnp.minimum(in_offsets_P[:, None] + i_c, x_RD.shape[0] - 1)
    sent_PcD = jnp.where((i_c < send_P[:, None])[..., None], x_RD[rows_Pc], 0)
    got_PcD = jax.lax.all_to_all(sent_PcD, axis, 0, 0, tiled=True)
    at_Pc = jnp.where(i_c < recv_P[:, None], out_offsets_P[:, None] + i_c, out_rows)
    out_RD = jnp.zeros((out_rows, x_RD.shape[1]), x_RD.dtype)
    return out_RD.at[at_Pc.reshape(-1)].set(got_PcD.reshape(-1, x_RD.shape[1]), mode='drop')

  return jax.lax.platform_dependent(x_RD, send_P, recv_P, in_offsets_P, out_offsets_P,
                                    cuda=ragged, default=padded)
