"""What a run's programs are compiled for, resolved once from config.plan, config.dry_run and the
devices here (by training.settings.resolve); every module after reads the Target, none asks
planning/gpus.py again.

  config.plan.target=''       the devices here (a GPU planning/gpus.py knows is planned as itself)
  config.plan.target='H100'   a dry run plans for H100s, config.plan.devices of them (0: as many
                              as there are devices here): on them, if these are they; else on
                              compile-only H100s (planning/gpu_compiler.py), in this process or,
                              where only a child process can have the compiler, in that child;
                              else on the devices here as a labelled stand-in. A run that trains
                              must be on H100s.

A plan fits when its total is within `memory_bytes`: config.plan.memory_gb, else what JAX's
allocator takes of the target GPU's memory, else the `bytes_limit` the devices here report (GPUs
do; a CPU does not).
"""

import dataclasses

from planning import gpu_compiler, gpus
import sharding


def check(plan_config) -> None:
  """config.plan against planning/gpus.py's table: a ValueError naming config.plan.target for a
  GPU it lacks."""
  if plan_config.target:
    gpus.get(plan_config.target)


@dataclasses.dataclass(frozen=True)
class Target:
  name: str  # what plans are for: config.plan.target, or the device kind here
  gpu: gpus.GPU | None  # name's GPU in planning/gpus.py; None for a CPU or a GPU it lacks
  n_devices: int  # how many devices the programs are for
  devices: tuple  # what this process compiles for: the devices here, or compile-only GPUs; ()
                  # where a child process compiles (in_child)
  in_child: bool  # a dry run planned by a child process that has the GPU compiler
  memory_bytes: int | None  # what a device offers a run; None if unknown
  memory_source: str  # where memory_bytes comes from
  deviceless: bool = False  # `devices` are compile-only GPUs (planning/gpu_compiler.py)

  @property
  def kernels(self) -> gpus.GPU | None:
    """The GPU whose kernels the programs are ranked for (timing.rank_attention): the target's,
    or the GPU here (an H100's figures for one planning/gpus.py lacks); None for a CPU run."""
    return self.gpu or compiled_for(self.devices)

  @property
  def on_gpu(self) -> bool:
    """Whether the programs compile for GPUs (a CPU stand-in for config.plan.target does not:
    cuDNN's kernels cannot compile there)."""
    return self.in_child or sharding.local_device(self.devices).platform == 'gpu'

  @property
  def gpus_per_node(self) -> int:
    """Devices to a node, filled in the mesh's device order as a multi-process job orders them."""
    return self.gpu.gpus_per_node if self.gpu else self.n_devices


def compiled_for(devices) -> gpus.GPU | None:
  """The GPU of planning/gpus.py that `devices` are (an H100 for one it lacks); None for a CPU."""
  device = sharding.local_device(devices)
  if device.platform != 'gpu':
    return None
  return gpus.find(device.device_kind) or gpus.GPUS['H100']


def resolve(plan_config, dry_run: bool, here) -> Target:
  """The Target of config.plan (`plan_config`) for a run on `here`, the devices of this process;
  a ValueError naming the setting for one it cannot plan or train on (module docstring)."""
  here = tuple(here)
  n = plan_config.devices or len(here)
  kind = sharding.local_device(here).device_kind
  if not dry_run and n != len(here):
    raise ValueError(f'config.plan.devices={n}, but a run that trains runs on the {len(here)} '
                     'devices here; add --config.dry_run=True to plan for another count, or '
                     'leave config.plan.devices at 0')
  if not plan_config.target:
    if n != len(here):
      raise ValueError(f'config.plan.devices={n} plans for that many GPUs of config.plan.target; '
                       f'name one of {sorted(gpus.GPUS)} (there are {len(here)} devices here)')
    return _with_memory(plan_config, Target(kind, gpus.find(kind), n, here, False, None, ''))
  gpu = gpus.get(plan_config.target)
  on_it = kind == gpu.device_kind
  if not dry_run and not on_it:
    raise ValueError(
        f'config.plan.target={plan_config.target!r} plans for {gpu.device_kind}, but this run '
        f'would train on {kind}; add --config.dry_run=True to plan without training, or leave '
        'config.plan.target empty to plan for the devices here')
  if on_it and n == len(here):
    devices, in_child = here, False  # planning on the GPUs themselves
  elif gpu_compiler.in_this_process():
    devices, in_child = tuple(gpu_compiler.devices(gpu, n)), False
    return _with_memory(plan_config, Target(gpu.name, gpu, n, devices, in_child, None, '', True))
  elif gpu_compiler.installed():
    devices, in_child = (), True
  elif n != len(here):
    raise ValueError(f'config.plan.devices={n} needs the GPU compiler (`{gpu_compiler.INSTALL}`);'
                     f' without it the plan is compiled for the {len(here)} devices here')
  else:
    devices, in_child = here, False  # a stand-in: the plan says so
  return _with_memory(plan_config, Target(gpu.name, gpu, n, devices, in_child, None, ''))


def _with_memory(plan_config, target: Target) -> Target:
  if plan_config.memory_gb:
    memory, source = int(plan_config.memory_gb * 1e9), 'config.plan.memory_gb'
  elif plan_config.target:
    memory, source = gpus.usable_memory_bytes(target.gpu), (
        f'{gpus.memory_fraction():.0%} of {target.gpu.name} '
        f'{target.gpu.memory_bytes / 2**30:,.2f} GiB, '
        "JAX's allocator (XLA_PYTHON_CLIENT_MEM_FRACTION)")
  else:
    stats = sharding.local_device(target.devices).memory_stats() or {}
    memory, source = stats.get('bytes_limit'), "the allocator's bytes_limit"
  return dataclasses.replace(target, memory_bytes=memory, memory_source=source)
