"""Running a kernel that XLA cannot partition (a Pallas call) on each device's shard, and where
XLA's partitioner fails inside a manual region (a pipeline stage's): the model names logical
axes, and these decide what a mesh makes of them."""

import flax.core.spmd
import flax.linen as nn
import jax


def mesh_axis(name: str) -> str | None:
  """The mesh axis that the logical axis `name` is split over under the active rules and mesh,
  for a kernel's own collectives along it (a ring over 'length'); None when it is not split."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax.core.spmd.get_logical_axis_rules():
    return None
  axes = nn.logical_to_mesh_axes((name,))[0]
  axes = [a for a in ((axes,) if isinstance(axes, str) else axes or ()) if mesh.shape[a] > 1]
  if len(axes) > 1:
    raise ValueError(f'logical axis {name!r} is split over mesh axes {axes}; a kernel collective '
                     'along it needs one (sharding/rules.py)')
  return axes[0] if axes else None


def per_shard(fn, in_names: tuple, out_names: tuple):
  """`fn` run by every device on its own shard of the arguments (jax.shard_map), the shards being
  where the logical axes `in_names` (one tuple per argument) and `out_names` put them under the
  active rules and mesh. Outside a mesh, or without rules, `fn` itself."""
  def run(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not flax.core.spmd.get_logical_axis_rules():
      return fn(*args)
    return jax.shard_map(fn, mesh=mesh, check_vma=False,
                         in_specs=tuple(nn.logical_to_mesh_axes(n) for n in in_names),
                         out_specs=nn.logical_to_mesh_axes(out_names))(*args)
  return run


def partitioned(fn, in_names: tuple, out_names: tuple):
  """`fn`, a call with a partitioner of its own (cuDNN's attention), left to XLA to partition;
  inside a manual region (a pipeline stage's), where that partitioner is handed shardings without
  a spec and fails, run per shard instead."""
  def run(*args):
    if jax.sharding.get_abstract_mesh().manual_axes:
      return per_shard(fn, in_names, out_names)(*args)
    return fn(*args)
  return run


def scatter_names(names: tuple) -> tuple:
  """The logical names to build a scatter's operand in: `names`, but inside a manual region (a
  pipeline stage's) with its first, scattered-into axis whole. XLA's partitioner fails there (a
  CHECK in spmd_partitioner_util) on a scatter into an operand split along that axis."""
  return (None, *names[1:]) if jax.sharding.get_abstract_mesh().manual_axes else names
