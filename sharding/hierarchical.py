"""Hierarchical, quantized partitioning over the `data` axis: ZeRO++'s hpZ, qwZ and qgZ as
settings of config.partition, the model unchanged.

The mesh's first axes vary slowest over the devices, so `data` is the level across nodes and the
axes after it (fsdp, expert, tensor, sequence, stage) lie inside a node, or fill whole nodes
(check_nodes). Plain FSDP over every GPU gathers each layer's weights across nodes twice a
microbatch and reduce-scatters its gradients there once. With `hierarchical`:
  - The state lives as ZeRO-3's, split over every device: each parameter, its fp32 master and
    Adam's moments are split over `data` too, along a dimension no other axis splits
    (`data_dims`).
  - Once a step the compute copy is gathered across `data` into the replica's shards,
    W[D_fsdp, F_tensor] again; the forward and backward then gather only inside the replica.
  - Each replica runs its own rows' microbatches and keeps its gradient in its shards (their
    in-replica reduce-scatters are the model's own); the replicas' sum is reduce-scattered across
    `data` once a step, to the master's shards (`apart`, called by training/step.py).
What that costs: the copy and the gradient, each P/inner elements a device in the gradient
reduction dtype (config.model.grad_reduce_dtype; inner = the devices of a replica), held through
the step, and with microbatches the gradient's accumulator too.

What crosses `data` may be quantized (`quantize`): int8 with one fp32 scale per block of BLOCK
elements along a parameter's last dimension.
  weights='int8'    the compute copy's gather (qwZ); the master is untouched, and the model
                    computes with the dequantized values, each within amax/254 of the master's,
                    amax its block's largest magnitude.
  gradients='int8'  the reduction (qgZ): each replica quantizes the share of its gradient bound
                    for every other, sends them by one all-to-all, and sums what it receives in
                    fp32: d summands, each within its block's amax/254.
Norm scales never are, and cross in their own fp32: they are few, and the model computes with
them so.

Sharded shapes, in scaling-book notation, on data d × fsdp f: master Wgate[L_data, D_fsdp, F]
(or along another free dimension), compute copy Wgate[L, D_fsdp, F]; a parameter with no free
dimension that divides by d is replicated over data and its gradient summed there.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from configs.base import MAX_LOGIT, PartitionConfig

AXIS = 'data'  # the level across nodes
BLOCK = 256  # elements per scale: 1.6% on top of the int8 bytes, and a bound per 256 values


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """How a run's parameters cross `data` (config.partition), each tree shaped as the parameters.
  Without `split` the state is replicated over data (plain data parallelism, HSDP): only the
  gradients' sum crosses, once a step."""
  split: bool  # config.partition.hierarchical
  weights: str  # one of SCHEMES
  gradients: str
  specs: object  # where each one's compute copy lives: its PartitionSpec without data
  dims: object  # the dimension each one's state splits over data along (data_dims); -1: none
  blocks: object  # the block its last dimension is quantized in (block_sizes)
  matrix: object  # whether it is one, not a norm scale: only matrices are quantized, and held in
                  # the gradient reduction dtype


def replicas_run_apart(experts: int, matmul_precision: str, frozen_base: bool = False) -> bool:
  """Whether a model's data replicas can each run their rows apart and sum gradients once a
  step: a dense one without fp8 or a frozen base. An MoE router's balancing loss is over the
  whole batch, and fp8's per-tensor scales need the whole batch's tensors; those are left to XLA,
  which reduces over data every microbatch, as it does the gradients of what trains on a frozen
  base (adapters, draft heads: small, and the base's none)."""
  return not experts and matmul_precision != 'fp8' and not frozen_base


PLAIN = PartitionConfig(hierarchical=False, weights='exact', gradients='exact')  # replicas


def check_partition(partition_config: PartitionConfig, mesh_config, model_config) -> None:
  """config.partition against config.mesh's data axis, and what the model trains that
  hierarchical=True does not run with, whatever the devices: ValueError naming the setting."""
  if not partition_config.hierarchical:
    return
  if mesh_config.data == 1 and not mesh_config.auto:
    raise ValueError('config.partition.hierarchical=True splits the state over config.mesh.data, '
                     'the level across nodes, and it is 1; set it to the number of nodes '
                     '(e.g. --config.mesh.data=2 --config.mesh.fsdp=-1)')
  if model_config.frozen_base:
    raise ValueError('config.partition.hierarchical=True splits a trained state over nodes; under '
                     'LoRA (config.model.lora_rank > 0) or config.model.draft_only only small '
                     'added parameters train, and their gradients are small: set it to False')
  if model_config.experts:
    raise ValueError('config.partition.hierarchical=True does not run MoE models yet: their '
                     "router's balancing loss is over the whole batch, which each data "
                     'replica would see only its share of; set it to False')
  if model_config.matmul_precision == 'fp8':
    raise ValueError("config.partition.hierarchical=True does not run with config.model."
                     "matmul_precision='fp8' yet: each data replica would scale its own share "
                     "of a tensor; use one of them")


def check_nodes(partition_config, mesh_sizes: dict, gpus_per_node: int) -> None:
  """Each data replica's devices within one node or filling whole nodes, so that a node's devices
  are all of one replica and only `data` crosses between replicas' nodes."""
  inner = math.prod(size for axis, size in mesh_sizes.items() if axis != AXIS)
  if partition_config.hierarchical and inner % gpus_per_node and gpus_per_node % inner:
    raise ValueError(f'config.partition.hierarchical=True: each data replica spans the axes after '
                     f'config.mesh.data, {inner} devices, which neither lie within a node of '
                     f'{gpus_per_node} GPUs nor fill whole nodes; make them a divisor or a multiple '
                     f'of {gpus_per_node} (e.g. config.mesh.data='
                     f'{math.prod(mesh_sizes.values()) // math.gcd(inner, gpus_per_node)})')


def hierarchy(partition_config, abstract_params, shardings, mesh) -> Hierarchy:
  """config.partition's Hierarchy for parameters of these (compute) shardings on `mesh`."""
  dims = data_dims(abstract_params, shardings, mesh)
  if not partition_config.hierarchical:
    dims = jax.tree.map(lambda _: -1, dims)
  specs = jax.tree.map(lambda sharding: sharding.spec, shardings)
  return Hierarchy(partition_config.hierarchical, partition_config.weights,
                   partition_config.gradients, specs, dims,
                   block_sizes(abstract_params, shardings, dims, mesh), matrices(abstract_params))


def matrices(abstract_params):
  """For each model parameter (an nnx Variable naming its logical axes), whether it is a matrix
  rather than a norm scale: what the model reads in the compute dtype, not in fp32."""
  return jax.tree.map(lambda v: v.replace('norm' not in (v.out_sharding or ())),
                      abstract_params, is_leaf=lambda x: hasattr(x, 'out_sharding'))


def data_dims(abstract_params, shardings, mesh):
  """For each parameter, the dimension its state splits over `data` along: the largest that no
  mesh axis of more than one device splits and that divides by the data axis; -1 for none."""
  d = mesh.shape[AXIS]

  def choose(a, sharding):
    spec = _padded(sharding.spec, a.ndim)
    free = [i for i, axes in enumerate(spec)
            if math.prod(mesh.shape[x] for x in _axes(axes)) == 1 and a.shape[i] % d == 0]
    return max(free, key=lambda i: (a.shape[i], -i)) if free else -1
  return jax.tree.map(choose, abstract_params, shardings)


def master_shardings(shardings, dims):
  """The parameter shardings with `data` added along each one's data dimension."""
  def add(sharding, dim):
    if dim < 0:
      return sharding
    return NamedSharding(sharding.mesh,
                         _with_data(sharding.spec, max(len(sharding.spec), dim + 1), dim))
  return jax.tree.map(add, shardings, dims)


def _axes(axes):
  return (axes,) if isinstance(axes, str) else tuple(axes or ())


def block_sizes(abstract_params, shardings, dims, mesh):
  """For each parameter, the block its last dimension is quantized in: BLOCK, or the largest
  power of two below it that divides the last dimension's share on a device (of the master, and
  of the compute copy), so that no block straddles devices."""
  def block(a, sharding, dim):
    spec = _padded(sharding.spec, a.ndim)
    n = a.shape[-1] // math.prod(mesh.shape[x] for x in _axes(spec[-1]))
    return math.gcd(n // (mesh.shape[AXIS] if dim == a.ndim - 1 else 1), BLOCK)
  return jax.tree.map(block, abstract_params, shardings, dims)


def quantize(x, block: int):
  """(q int8, scale fp32) with x ≈ q · scale, one scale per `block` elements of the last
  dimension: scale = amax/127 maps the block's largest magnitude
  onto 127, so nothing clips and every element rounds to within scale/2 = amax/254. A block of
  zeros has scale 1 and q 0. A block holding inf or NaN gets a NaN scale, so it dequantizes to
  NaN (never inf), for the step's non-finite guard to skip."""
  n = x.shape[-1]
  x_nb = x.astype(jnp.float32).reshape(*x.shape[:-1], n // block, block)
  amax = jnp.max(jnp.abs(x_nb), axis=-1, keepdims=True)
  scale = jnp.where(jnp.isfinite(amax), jnp.where(amax > 0, amax / 127, 1.0), jnp.nan)
  q = jnp.clip(jnp.round(jnp.nan_to_num(x_nb / scale)), -127, 127).astype(jnp.int8)
  return q.reshape(x.shape), scale[..., 0]


def dequantize(q, scale, dtype=jnp.float32):
  """q · scale in `dtype`, the inverse of `quantize` (the block from the two shapes)."""
  n, blocks = q.shape[-1], scale.shape[-1]
  q_nb = q.astype(jnp.float32).reshape(*q.shape[:-1], blocks, n // blocks)
  return (q_nb * scale[..., None]).reshape(q.shape).astype(dtype)


def _pin(x, spec):
  return jax.lax.with_sharding_constraint(x, spec)


def _padded(spec, ndim: int) -> tuple:
  """A PartitionSpec's entries for all `ndim` dimensions (a spec may leave trailing ones out)."""
  return tuple(spec) + (None,) * (ndim - len(spec))


def _with_data(spec, ndim: int, dim: int):
  """`spec` (ndim entries) with `data` at `dim`."""
  spec = list(_padded(spec, ndim))
  spec[dim] = AXIS
  return P(*spec)


def _quantized_here(x, spec, block: int):
  """quantize(x) where x lies, laid out as `spec`: pinned, and behind a barrier, so that XLA
  moves the int8 result to where it is wanted, never x or the steps of quantizing it."""
  q, scale = quantize(_pin(x, spec), block)
  return jax.lax.optimization_barrier((_pin(q, spec), _pin(scale, spec)))


def to_compute(w, spec, dim: int, scheme: str, dtype, block: int):
  """The master `w` (split over data along `dim`) as the compute copy in `dtype`, laid out as
  `spec`: gathered across data in `dtype`, or as int8 blocks dequantized after the gather."""
  if dim < 0:
    return _pin(w.astype(dtype), spec)
  master = _with_data(spec, w.ndim, dim)
  if scheme == 'exact':  # cast where it lies, so that the gather moves `dtype`
    return _pin(_pin(w.astype(dtype), master), spec)
  q, scale = _quantized_here(w, master, block)
  q, scale = _pin(q, spec), _pin(scale, spec)  # the gather, of int8 and scales
  return _pin(dequantize(q, scale, dtype), spec)


def reduce(g_d, spec, dim: int, scheme: str, block: int):
  """The sum of the replicas' gradients `g_d` [d, ...] (replica r's at row r, laid out as `spec`
  after it) as the master's shard: reduce-scattered across data in their dtype, or summed
  everywhere for a parameter without a data dimension. `scheme` 'int8': each replica sends
  every other the share bound for it as int8 blocks by one all-to-all, and sums what it
  receives in fp32."""
  ndim = g_d.ndim - 1
  if dim < 0 or scheme == 'exact':
    # lax's sum stays in g_d's dtype (the reduction dtype): jnp.sum would add bf16 in fp32, and
    # send fp32.
    summed = jax.lax.reduce(g_d, jnp.zeros((), g_d.dtype), jax.lax.add, (0,))
    return _pin(summed, _with_data(spec, ndim, dim) if dim >= 0 else spec)
  d, shape = g_d.shape[0], g_d.shape[1:]
  spec = _padded(spec, ndim)
  # [d, .., n, ..] → [d, .., d, n/d, ..]: the share of replica r's gradient bound for replica j
  # at [r, .., j].
  g_dd = g_d.reshape(d, *shape[:dim], d, shape[dim] // d, *shape[dim + 1:])
  sent = P(AXIS, *spec[:dim], None, None, *spec[dim + 1:])
  received = P(None, *spec[:dim], AXIS, None, *spec[dim + 1:])
  q, scale = _quantized_here(g_dd, sent, block)
  q, scale = _pin(q, received), _pin(scale, received)  # the all-to-all
  summed = dequantize(q, scale).sum(axis=0).reshape(shape)
  return _pin(summed, _with_data(spec, ndim, dim))


def apart(h: Hierarchy, mesh, gradients, master, batch, dtype, reduce_dtype, reference=None,
          weight=None):
  """gradients(compute, reference, batch_shard, total) → ((loss, (loss terms, router stats, draft
  sums)), grads), run by the data replicas apart: with `h.split` the compute copy is gathered
  across data from the master's shards once (in `dtype`, the compute dtype, where quantized); each
  replica runs its own rows in a region manual over data, its gradients kept in its shards; their
  sum is reduce-scattered to the master's shards once (or, the parameters replicated over data,
  all-reduced once). The losses are the whole batch's: `total`, the weight they divide by (the
  sum of `weight` of each replica's rows, default their weights' sum), is. `reference`: parameters laid out as `master` that
  the loss reads without a gradient (DPO's reference model), given a compute copy the same way.

  The region is untyped (check_vma=False): the copy is the same on every replica, and typed so,
  autodiff would sum each use's gradient over the replicas there and then, every microbatch.

  A hierarchical copy and its gradients are held in `reduce_dtype`, the gradient reduction dtype
  (norm scales in their own): the values the model computes with are the master's in the compute
  dtype either way."""
  def compute_copy(w, spec, dim, block, matrix):
    if not h.split:  # replicated over data: the parameters themselves
      return w
    scheme, cast = (h.weights, dtype) if matrix else ('exact', w.dtype)
    return to_compute(w, spec, dim, scheme, cast, block).astype(
        reduce_dtype if matrix else w.dtype)

  def region(compute, reference, batch):
    mine = weight(batch) if weight else batch['weights'].sum()
    total = jnp.maximum(jax.lax.psum(mine, AXIS), 1.0)
    (loss, (terms, router, drafted)), grads = gradients(compute, reference, batch, total)
    # Summed across data in the reduction dtype, as inside the replica (norm scales in fp32).
    grads = jax.tree.map(lambda g, matrix: (g.astype(reduce_dtype) if matrix else g)[None],
                         grads, h.matrix)
    if MAX_LOGIT in router:  # QK-clip's measure: the largest of every replica's
      router = {**router, MAX_LOGIT: jax.lax.pmax(router[MAX_LOGIT], AXIS)}
    return jax.lax.psum((loss, terms, drafted), AXIS), router, grads

  compute = jax.tree.map(compute_copy, master, h.specs, h.dims, h.blocks, h.matrix)
  if reference is not None:
    reference = jax.lax.stop_gradient(
        jax.tree.map(compute_copy, reference, h.specs, h.dims, h.blocks, h.matrix))
  (loss, terms, drafted), router, grads_d = jax.shard_map(
      region, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P(), P(AXIS)),
      axis_names={AXIS}, check_vma=False)(compute, reference, batch)
  grads = jax.tree.map(
      lambda w, g_d, spec, dim, block, matrix: reduce(
          g_d, spec, dim, h.gradients if matrix else 'exact', block).astype(w.dtype),
      master, grads_d, h.specs, h.dims, h.blocks, h.matrix)
  return (loss, (terms, router, drafted)), grads
