"""Pipeline parallelism: the stacked layers split into stages over a mesh axis, microbatches
flowing through them, all inside the one compiled step.

The layers run as V·P chunks of n/(V·P) consecutive layers, chunk c on stage c mod P: stage s holds
chunks s, s+P, s+2P, … (V = config.model.virtual_stages; V = 1 is GPipe, each stage holding n/P
consecutive layers). The stacked parameters are [V, n/V, …] for V > 1 with the second dimension
split over stages, so each stage's chunks are its own shard and no stage ever sees another's
weights.

The schedule is one `lax.scan` over T = V·M + P − 1 ticks, so compile time does not grow with
microbatches, stages or chunks. Work item i = v·M + m is microbatch m's v-th loop through the
stages: at tick t stage s runs item t − s on its chunk v, then passes the result to stage s + 1
with a collective-permute. Stage 0 takes loop 0 from the input and loop v > 0 from what the last
stage handed round the ring at the end of loop v − 1 (it arrives M − P ticks before it is needed,
so M ≥ P). Ticks where a stage has no item are the bubble: P − 1 of T, each a chunk's work, so
the idle share is (P − 1)/(V·M + P − 1); V chunks cost V times the permutes.

The backward is autodiff through the scan: it runs the ticks in reverse, each stage's gradient
flowing back to the stage before it by the transposed permute. Each stage keeps what its layers'
remat policy saves, for every tick (GPipe's memory: M microbatches of its layers' activations).
"""

import jax
import jax.numpy as jnp


def ticks(microbatches: int, stages: int, virtual_stages: int = 1) -> int:
  """Schedule length: every microbatch through every stage's every chunk."""
  return virtual_stages * microbatches + stages - 1


def bubble_fraction(microbatches: int, stages: int, virtual_stages: int = 1) -> float:
  """The share of each stage's ticks spent without a microbatch."""
  return (stages - 1) / ticks(microbatches, stages, virtual_stages)


def split(x, microbatches: int):
  """[B, ...] → [M, B/M, ...], microbatch m = rows m, m+M, m+2M, …: a device's rows hold an equal
  share of every microbatch, so splitting moves no data."""
  return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def merge(x):
  """`split`'s inverse: [M, B/M, ...] → [B, ...]."""
  return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def schedule(run_layers, layers, x_MbLD, extras_Mb, axis: str, loops: int = 1):
  """run_layers(layers, x_bLD, extras_b) → (y_bLD, stats) applied to every microbatch of x_MbLD
  through all the stages' layers, inside `sharding.per_stage`; `stats` holds an array per layer of the
  chunk run (the MoE router's, model/moe.py; or nothing). `layers` is this stage's share: [n/P, …] for GPipe, or
  with `loops` = V > 1 virtual stages its chunks, [V, n/(V·P), …]; extras_Mb (a pytree of
  per-microbatch arrays, such as positions) go with each microbatch. Returns y_MbLD on the last
  stage and zeros on the others, for `to_every_stage` or `shares`; and the stats of every layer
  [n, …] in execution order, each the mean over microbatches, the same on every stage.

  With V > 1, run_layers(layers, x_bLD, extras_b, chunk=v) must run row v of the chunks, taking
  each layer's weights with `pick` inside the layer's remat region: a chunk's weights are then
  sliced again for the backward, not kept for every tick (a copy of the stage's weights per
  microbatch)."""
  stages, microbatches = jax.lax.axis_size(axis), x_MbLD.shape[0]
  items = loops * microbatches
  stage = jax.lax.axis_index(axis)
  # With chunks the last stage hands each microbatch back to the first: a ring.
  pairs = [(s, (s + 1) % stages) for s in range(stages if loops > 1 else stages - 1)]
  dtype = x_MbLD.dtype
  # Stage 0's next input for each microbatch: the input, then each loop's output. Made per-stage
  # once, so that the input's gradient is summed over stages once rather than at every tick.
  # Both sums over stages are taken in fp32: XLA's CPU compiler fails (a CHECK in
  # AllReducePromotion) on these bf16 all-reduces.
  inputs_MbLD = jax.lax.pcast(x_MbLD.astype(jnp.float32), axis, to='varying')

  def tick(carry, t):
    received_bLD, inputs_MbLD, stats_V = carry
    if loops > 1:  # what the last stage finished a tick ago (item t − P) is a next loop's input
      back = t - stages
      slot = jnp.mod(back, microbatches)
      keep = (stage == 0) & (back >= 0) & (back < items - microbatches)
      inputs_MbLD = inputs_MbLD.at[slot].set(
          jnp.where(keep, received_bLD.astype(jnp.float32), inputs_MbLD[slot]))
    item = jnp.clip(t - stage, 0, items - 1)  # this stage's work (clamped in the bubble)
    m, v = item % microbatches, item // microbatches
    x_bLD = jnp.where(stage == 0, inputs_MbLD[m].astype(dtype), received_bLD)
    extras_b = jax.tree.map(lambda e: e[m], extras_Mb)
    y_bLD, stats = (run_layers(layers, x_bLD, extras_b) if loops == 1 else
                    run_layers(layers, x_bLD, extras_b, chunk=v))
    # A tick in the bubble computed nothing: its stats are not counted.
    busy = (t - stage >= 0) & (t - stage < items)
    stats_V = jax.tree.map(
        lambda acc, a: acc.at[v].add(jnp.where(busy, a.astype(jnp.float32), 0) / microbatches),
        stats_V, stats)
    return (jax.lax.ppermute(y_bLD, axis, pairs), inputs_MbLD, stats_V), y_bLD

  shapes = jax.eval_shape(lambda x, e: (run_layers(layers, x, e) if loops == 1 else
                                        run_layers(layers, x, e, chunk=0))[1],
                          inputs_MbLD[0].astype(dtype), jax.tree.map(lambda e: e[0], extras_Mb))
  stats_V = jax.tree.map(lambda a: jax.lax.pcast(jnp.zeros((loops, *a.shape), jnp.float32),
                                                 axis, to='varying'), shapes)
  (_, _, stats_V), y_TbLD = jax.lax.scan(
      tick, (jnp.zeros_like(inputs_MbLD[0], dtype), inputs_MbLD, stats_V),
      jnp.arange(ticks(microbatches, stages, loops)))
  # Only the last stage's last loop is the result.
  y_MbLD = jnp.where(stage == stages - 1, y_TbLD[items - microbatches + stages - 1:], 0)
  return y_MbLD, jax.tree.map(lambda a: _every_layer(a, axis), stats_V)


def _every_layer(stats_Vc, axis: str):
  """A stage's per-chunk stats [V, n/(V·P), …] → every layer's [n, …] in execution order on every
  stage: chunk v·P + s is stage s's row v."""
  stages, stage = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  V, c = stats_Vc.shape[:2]
  all_VPc = jnp.zeros((V, stages, c, *stats_Vc.shape[2:]), jnp.float32)
  all_VPc = jax.lax.dynamic_update_index_in_dim(all_VPc, stats_Vc[:, None], stage, axis=1)
  return jax.lax.psum(all_VPc, axis).reshape(V * stages * c, *stats_Vc.shape[2:])


# The sums over stages below are taken in fp32, as the schedule's are.

def to_every_stage(y_MbLD, axis: str):
  """The schedule's result (the last stage's) on every stage: a sum over stages."""
  return jax.lax.psum(y_MbLD.astype(jnp.float32), axis).astype(y_MbLD.dtype)


def _per_stage(microbatches: int, axis: str) -> int:
  return -(-microbatches // jax.lax.axis_size(axis))


def _padded(x_M, rows: int):
  return jnp.pad(x_M, [(0, rows - x_M.shape[0])] + [(0, 0)] * (x_M.ndim - 1))


def shares(y_MbLD, axis: str):
  """The schedule's result split among the stages for the work after it (the head and loss):
  stage s takes microbatches s·m … s·m + m − 1, m = ⌈M / P⌉ (the last stages' padded with zero
  rows). Handed to every stage by a sum, each keeps its share: XLA partitions a reduce-scatter
  over stages by gathering the microbatches' rows over the other axes first."""
  summed_MbLD = jax.lax.psum(y_MbLD.astype(jnp.float32), axis)
  return own_share(summed_MbLD, axis).astype(y_MbLD.dtype)  # its backward sums in fp32 too


def own_share(x_Mb, axis: str):
  """This stage's share (as `shares` makes it) of x_Mb, which every stage holds whole."""
  m = _per_stage(x_Mb.shape[0], axis)
  x_Mb = _padded(x_Mb, m * jax.lax.axis_size(axis))
  return jax.lax.dynamic_slice_in_dim(x_Mb, jax.lax.axis_index(axis) * m, m)


def pick(w, chunk, layer):
  """w[chunk, layer] of a stage's stacked [V, n/(V·P), …] weights, in the primitives that
  `recompute_picks` does not save."""
  start = (chunk, layer) + (0,) * (w.ndim - 2)
  return jax.lax.squeeze(jax.lax.dynamic_slice(w, start, (1, 1, *w.shape[2:])), (0, 1))


def recompute_picks(primitive, *_, **__):
  """A remat policy that saves everything but `pick`'s slices (for layers with no policy of
  their own, run as chunks)."""
  return primitive not in (jax.lax.dynamic_slice_p, jax.lax.squeeze_p)
