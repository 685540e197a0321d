"""The device mesh from `config.mesh` (MeshConfig): axes data, stage, fsdp, expert, tensor,
sequence. The first axes vary slowest over the devices, so data and stage are the ones that span
nodes."""

import math

import jax
from jax.sharding import AxisType, Mesh

from configs.base import AXES, check_sizes  # the axes, and their settings' checks


class MeshMismatch(ValueError):
  """A mesh shape that the devices, the model or the batch cannot use (the auto-layout search
  skips such shapes; any other ValueError is a mistake in the settings)."""


def mesh_shape(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
  """{axis: size} from config.mesh's (MeshConfig.sizes), at most one -1 resolved to the devices
  left over."""
  sizes = {axis: int(sizes[axis]) for axis in AXES}
  check_sizes(sizes)
  free = [axis for axis, size in sizes.items() if size == -1]
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if n_devices % fixed:
      raise MeshMismatch(f'config.mesh: the fixed axes multiply to {fixed}, which does not divide '
                         f'the {n_devices} devices, so config.mesh.{free[0]}=-1 cannot take the '
                         'rest')
    sizes[free[0]] = n_devices // fixed
  elif fixed != n_devices:
    raise MeshMismatch(
        f'config.mesh: {"×".join(AXES)} = {"×".join(str(sizes[a]) for a in AXES)} = '
        f'{fixed}, but there are {n_devices} devices; make the product {n_devices} or set one '
        'axis to -1 (e.g. --config.mesh.fsdp=-1)')
  return sizes


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
  """A mesh of these axis sizes (MeshConfig.sizes) over `devices` (default: all). Auto axes:
  XLA's partitioner propagates shardings from the ones we pin (parameters, batch, activations at
  layer boundaries)."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(sizes, len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices)


def local_device(devices):
  """The first of `devices` this process can address (only those report memory)."""
  return next(d for d in devices if d.process_index == jax.process_index())


def describe(sizes: dict) -> str:
  """'data=1 × stage=1 × fsdp=8 × tensor=1 × sequence=1' for {axis: size} (a mesh's .shape, say)."""
  return ' × '.join(f'{axis}={size}' for axis, size in sizes.items())
