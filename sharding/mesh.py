"""The device mesh from `config.mesh`: axes data, stage, fsdp, expert, tensor, sequence. The
first axes vary slowest over the devices, so data and stage are the ones that span nodes."""

import math

import jax
from jax.sharding import AxisType, Mesh

AXES = ('data', 'stage', 'fsdp', 'expert', 'tensor', 'sequence')


class MeshMismatch(ValueError):
  """A mesh shape that the devices, the model or the batch cannot use (the auto-layout search
  skips such shapes; any other ValueError is a mistake in the settings)."""


def check_mesh_config(mesh_config) -> None:
  """What config.mesh says about itself: known axes, sizes positive or -1, at most one -1."""
  if unknown := set(mesh_config) - set(AXES) - {'auto'}:  # auto: training/layout.py
    raise ValueError(f'config.mesh has unknown axes {sorted(unknown)}; the axes are {AXES}')
  sizes = {axis: mesh_config[axis] for axis in AXES}
  if bad := [axis for axis, size in sizes.items() if size == 0 or size < -1]:
    raise ValueError(f'config.mesh.{bad[0]}={sizes[bad[0]]}: axis sizes are positive, or -1 for '
                     'the remaining devices')
  if len(free := [axis for axis, size in sizes.items() if size == -1]) > 1:
    raise ValueError(f'config.mesh: only one axis may be -1, got {free}')


def mesh_shape(mesh_config, n_devices: int) -> dict[str, int]:
  """{axis: size} from config.mesh, resolving at most one -1 to the devices left over."""
  check_mesh_config(mesh_config)
  sizes = {axis: int(mesh_config[axis]) for axis in AXES}
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


def make_mesh(mesh_config, devices=None) -> Mesh:
  """A mesh over `devices` (default: all). Auto axes: XLA's partitioner propagates shardings
  from the ones we pin (parameters, batch, activations at layer boundaries)."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_config, len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES),
                       devices=devices)


def local_device(devices):
  """The first of `devices` this process can address (only those report memory)."""
  return next(d for d in devices if d.process_index == jax.process_index())


def describe(sizes: dict) -> str:
  """'data=1 × stage=1 × fsdp=8 × tensor=1 × sequence=1' for {axis: size} (a mesh's .shape, say)."""
  return ' × '.join(f'{axis}={size}' for axis, size in sizes.items())
