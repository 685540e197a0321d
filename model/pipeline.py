"""Pipeline parallelism (GPipe): the stacked layers split into consecutive stages over a mesh axis,
microbatches flowing through them, all inside the one compiled step.

Stage s holds layers [s·n/P, (s+1)·n/P) (the 'layers' dimension of every stacked parameter is
split over the stage axis, so no stage ever sees another's weights). The schedule is one
`lax.scan` over T = M + P − 1 ticks, so compile time does not grow with microbatches or stages: at
tick t stage s runs its layers on microbatch t − s, then passes the result to stage s + 1 with a
collective-permute. Stage 0 takes microbatch t from the input; the last stage's outputs are the
result. Ticks where a stage has no microbatch (t < s or t − s ≥ M) are the bubble: (P − 1) of T.

The backward is autodiff through the scan: it runs the ticks in reverse, each stage's gradient
flowing back to the stage before it by the transposed permute. Each stage keeps what its layers'
remat policy saves, for every tick (GPipe's memory: M microbatches of its layers' activations).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def ticks(microbatches: int, stages: int) -> int:
  """Schedule length: every microbatch through every stage."""
  return microbatches + stages - 1


def bubble_fraction(microbatches: int, stages: int) -> float:
  """The share of each stage's ticks spent without a microbatch."""
  return (stages - 1) / ticks(microbatches, stages)


def split(x, microbatches: int):
  """[B, ...] → [M, B/M, ...], microbatch m = rows m, m+M, m+2M, …: a device's rows hold an equal
  share of every microbatch, so splitting moves no data."""
  return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def merge(x):
  """`split`'s inverse: [M, B/M, ...] → [B, ...]."""
  return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def over_stages(forward, axis: str):
  """forward(staged, shared, *args) run by each stage of mesh axis `axis` on its own part: the
  leaves of `staged` are split over `axis` along their first dimension, everything else is whole
  on every stage, and so is the result. Nothing outside the pipeline is left for XLA to split
  over stages (it would move parameters between them to do so): each stage computes the rest
  itself, and what no stage varies (the embedding, the head, their gradients) needs no collective
  across stages."""
  mesh = jax.sharding.get_abstract_mesh()
  return lambda staged, shared, *args: jax.shard_map(
      forward, mesh=mesh, in_specs=(P(axis), P(), *(P() for _ in args)), out_specs=P(),
      axis_names={axis}, check_vma=True)(staged, shared, *args)


def gpipe(run_layers, layers, x_MbLD, extras_Mb, axis: str):
  """run_layers(layers, x_bLD, extras_b) applied to every microbatch of x_MbLD through all the
  stages' layers (this stage's `layers` are its share), inside `over_stages`; extras_Mb (a pytree
  of per-microbatch arrays, such as positions) go with each microbatch. Returns y_MbLD, the same
  on every stage."""
  stages, microbatches = jax.lax.axis_size(axis), x_MbLD.shape[0]
  stage = jax.lax.axis_index(axis)
  forward = [(s, s + 1) for s in range(stages - 1)]
  dtype = x_MbLD.dtype
  # Stage 0 reads the input at every tick: made per-stage once, so that its gradient is summed
  # over stages once rather than at every tick. Both sums over stages are taken in fp32: XLA's
  # CPU compiler fails (a CHECK in AllReducePromotion) on these bf16 all-reduces.
  x_MbLD = jax.lax.pcast(x_MbLD.astype(jnp.float32), axis, to='varying')

  def tick(received_bLD, t):
    m = jnp.clip(t - stage, 0, microbatches - 1)  # this stage's microbatch (clamped in the bubble)
    x_bLD = jnp.where(stage == 0, x_MbLD[jnp.minimum(t, microbatches - 1)].astype(dtype),
                      received_bLD)
    y_bLD = run_layers(layers, x_bLD, jax.tree.map(lambda e: e[m], extras_Mb))
    return jax.lax.ppermute(y_bLD, axis, forward), y_bLD

  _, y_TbLD = jax.lax.scan(tick, jnp.zeros_like(x_MbLD[0], dtype),
                           jnp.arange(ticks(microbatches, stages)))
  # Only the last stage's outputs are the result; the sum over stages hands them to every stage.
  y_MbLD = jnp.where(stage == stages - 1, y_TbLD[stages - 1:], 0).astype(jnp.float32)
  return jax.lax.psum(y_MbLD, axis).astype(dtype)
