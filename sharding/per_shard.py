"""Running a kernel that XLA cannot partition (a Pallas call) on each device's shard, a pipeline
stage's forward on its own layers, and where XLA's partitioner fails inside a manual region (a
pipeline stage's): the model names logical axes, and these decide what a mesh makes of them; the
model itself never holds a mesh or a PartitionSpec."""

import math

import flax.core.spmd
import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from sharding.rules import PARAM_RULES


def mesh_axis(name: str) -> str | None:
  """The mesh axis that the logical axis `name` is split over under the active rules and mesh,
  for a kernel's own collectives along it (a ring over 'length'); None when it is not split."""
  axes = mesh_axes(name)
  if len(axes) > 1:
    raise ValueError(f'logical axis {name!r} is split over mesh axes {list(axes)}; a kernel '
                     'collective along it needs one (sharding/rules.py)')
  return axes[0] if axes else None


def mesh_axes(name: str, params: bool = False) -> tuple[str, ...]:
  """The mesh axes of more than one device that the logical axis `name` is split over, in order:
  under the active rules (how the computation is split) or, with `params`, where parameters live
  (PARAM_RULES). () off a mesh or without rules."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax.core.spmd.get_logical_axis_rules():
    return ()
  axes = nn.logical_to_mesh_axes((name,), PARAM_RULES if params else None)[0]
  return tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if mesh.shape[a] > 1)


def axes_size(axes) -> int:
  """How many devices the mesh axes `axes` (names, as `mesh_axes` gives them) span together."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in axes)


def token_gradient_axes(what: str, model_axis: str = 'embed', split: str | None = None
                        ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
  """(token axes, scatter, summed) for a parameter's gradient summed over every device's
  tokens: the mesh axes the tokens ('batch', 'length') are split over, those of them that also
  split its model dimension (`model_axis` where parameters live: reduce-scattered there), and the
  rest (summed), less those splitting its logical axis `split` ('experts': the tokens came to
  their experts' devices, so their sum is already whole). `what` names the parameter in the
  error when the tokens do not cover that split."""
  tokens = tuple(a for name in ('batch', 'length') for a in mesh_axes(name))
  scatter = mesh_axes(model_axis, params=True)
  if set(scatter) - set(tokens):
    raise ValueError(f'{what} is split over {scatter} along its model dimension, but the tokens '
                     f'only over {tokens} (sharding/rules.py)')
  whole = scatter + (mesh_axes(split, params=True) if split else ())
  return tokens, scatter, tuple(a for a in tokens if a not in whole)


class Params(tuple):
  """Logical names of an output of `per_shard` laid out where parameters live (PARAM_RULES), such
  as a gradient the function reduce-scatters itself."""


def _spec(names):
  return nn.logical_to_mesh_axes(names, PARAM_RULES if isinstance(names, Params) else None)


def per_shard(fn, in_names: tuple, out_names: tuple):
  """`fn` run by every device on its own shard of the arguments (jax.shard_map), the shards being
  where the logical axes `in_names` (one tuple per argument) and `out_names` (one tuple, or for
  several outputs a list of them) put them under the active rules and mesh. Outside a mesh, or
  without rules, `fn` itself.

  In a manual region (a pipeline stage's) the results are typed as varying over every manual
  axis an argument varies over. shard_map without type checks would type them invariant, and
  the backward would then make their cotangents, which differ from stage to stage, invariant
  by summing them over the stages."""
  def run(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not flax.core.spmd.get_logical_axis_rules():
      return fn(*args)
    out_specs = (tuple(map(_spec, out_names)) if isinstance(out_names, list)
                 else _spec(out_names))
    out = jax.shard_map(fn, mesh=mesh, check_vma=False,
                        in_specs=tuple(map(_spec, in_names)), out_specs=out_specs)(*args)
    axes = frozenset().union(*map(_varying, jax.tree.leaves(args)))
    return jax.tree.map(lambda y: _vary(y, axes), out) if axes else out
  return run


def _vary(y, axes: frozenset):
  missing = tuple(sorted(axes - _varying(y)))
  return jax.lax.pcast(y, missing, to='varying') if missing else y


def _varying(x) -> frozenset:
  """The manual axes (a pipeline stage's) over which x's value varies."""
  aval = jax.typeof(x)
  return frozenset(aval.vma if hasattr(aval, 'vma') else aval.manual_axis_type.varying)


def varying_like(y, x):
  """y typed as varying over the manual axes x varies over (its value unchanged): for a gradient
  computed per shard, whose type must match its primal's in a custom VJP."""
  return _vary(y, _varying(x))


def partitioned(fn, in_names: tuple, out_names: tuple):
  """`fn`, a call with a partitioner of its own (cuDNN's attention), left to XLA to partition;
  inside a manual region (a pipeline stage's), where that partitioner is handed shardings without
  a spec and fails, run per shard instead."""
  def run(*args):
    if jax.sharding.get_abstract_mesh().manual_axes:
      return per_shard(fn, in_names, out_names)(*args)
    return fn(*args)
  return run



def per_stage(forward, axis: str, staged_dim: int = 0):
  """forward(staged, shared, *args) run by each stage of mesh axis `axis` on its own part
  (model/pipeline.py): the leaves of `staged` are split over `axis` along dimension `staged_dim`,
  everything else is whole on every stage, and so is the result. Nothing outside the pipeline is
  left for XLA to split over stages (it would move parameters between them to do so): each stage
  computes the rest itself, and what no stage varies (the embedding and its gradient) needs no
  collective across stages. The head and loss are split among the stages by microbatch
  (`pipeline.shares`), so the head's weight gradient is summed over them, and so are the loss's
  sums."""
  mesh = jax.sharding.get_abstract_mesh()
  staged = P(*(None,) * staged_dim, axis)
  return lambda staged_tree, shared, *args: jax.shard_map(
      forward, mesh=mesh, in_specs=(staged, P(), *(P() for _ in args)), out_specs=P(),
      axis_names={axis}, check_vma=True)(staged_tree, shared, *args)
