"""Plans a run before anything is allocated: the train step compiled ahead of time for the
configured mesh from the abstract state, and what the compiled program says about it.

  python train.py --config=configs/llama.py:8b --config.dry_run=True --config.plan.target=H100

Per device: argument bytes (parameters, optimizer state, batch), output bytes, temporaries
(activations, gradients, workspace), total = arguments + outputs + temporaries − aliased (the
donated state is updated in place); FLOPs per step (the model's, training/flops.py, as MFU counts
them; XLA's own count is `compiled_flops`, which counts a scanned layer once); the collectives
in the program text. `config.plan.target` plans for another device than the ones present (e.g.
H100 when planning on CPU with fake devices, XLA_FLAGS=--xla_force_host_platform_device_count=8);
its memory, or `config.plan.memory_gb`, is what a real run must fit in before it allocates.
A CPU compile stands in for a GPU one only approximately: arguments are exact, temporaries follow
the CPU compiler's choices (and XLA attention materialises its scores; cuDNN and Pallas don't).
"""

import dataclasses
import json

import jax

from sharding import collectives
from training import flops as flops_lib
from training import metrics
from training import step as step_lib
from training.state import Setup, local_device

MEMORY_GB = {'A100': 80, 'H100': 80, 'H200': 141}  # HBM per device (the 80 GB A100 and H100)


@dataclasses.dataclass
class Plan:
  device: str
  n_devices: int
  mesh: dict
  remat_policy: str
  microbatches: int
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  total_bytes: int
  host_bytes: int  # in pinned host memory (offloaded optimizer state or activations), if reported
  flops: float  # per device per step, the model's (training/flops.py)
  compiled_flops: float  # XLA's cost analysis of the per-device program
  collectives: dict  # {op: {'count', 'bytes'}} in the program text
  memory_bytes: int | None  # what the target device offers; None if unknown

  @property
  def fits(self) -> bool | None:
    return None if self.memory_bytes is None else self.total_bytes <= self.memory_bytes


def target_device(config, devices) -> str:
  return config.plan.target or devices[0].device_kind


def memory_bytes(config, devices) -> int | None:
  """Per-device memory a run must fit in: config.plan.memory_gb, else the target's, else what
  the backend reports for the devices in use (GPUs do; the CPU does not)."""
  if config.plan.memory_gb:
    return int(config.plan.memory_gb * 1e9)
  if config.plan.target:
    if config.plan.target not in MEMORY_GB:
      raise ValueError(f'config.plan.target={config.plan.target!r} is not one of '
                       f'{sorted(MEMORY_GB)}; or give config.plan.memory_gb')
    return MEMORY_GB[config.plan.target] * 10**9
  stats = local_device(devices).memory_stats() or {}
  return stats.get('bytes_limit')


def make_plan(compiled, setup: Setup, config, devices) -> Plan:
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per program
  n = setup.mesh.size
  tokens = config.batch_size * config.seq_len
  return Plan(
      device=target_device(config, devices), n_devices=n, mesh=dict(setup.mesh.shape),
      remat_policy=config.model.remat_policy, microbatches=config.microbatches,
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      temp_bytes=memory.temp_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
      total_bytes=(memory.argument_size_in_bytes + memory.output_size_in_bytes
                   + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
      host_bytes=(memory.host_argument_size_in_bytes + memory.host_output_size_in_bytes
                  + memory.host_temp_size_in_bytes - memory.host_alias_size_in_bytes),
      flops=flops_lib.flops_per_token(setup.model_cfg, config.seq_len) * tokens / n,
      compiled_flops=float((cost or {}).get('flops', 0.0)),
      collectives=collectives.summary(compiled.as_text()),
      memory_bytes=memory_bytes(config, devices))


def check_fits(plan: Plan) -> None:
  """Before a real run allocates: the compiled step's memory within the device's."""
  if plan.fits is False:
    raise ValueError(
        f'the train step needs {readable_bytes(plan.total_bytes)} per device (arguments '
        f'{readable_bytes(plan.argument_bytes)}, temporaries {readable_bytes(plan.temp_bytes)}) but a {plan.device} has '
        f'{readable_bytes(plan.memory_bytes)}; recompute more (config.model.remat_policy='
        f'{plan.remat_policy!r} → full), shard the state over more devices (config.mesh.fsdp), '
        f'or split the batch (config.microbatches={plan.microbatches} → '
        f'{plan.microbatches * 2}). `--config.dry_run=True` shows the plan without running')


def readable_bytes(n: int | None) -> str:
  if n is None:
    return 'unknown'
  return f'{n / 2**30:,.2f} GiB' if n >= 2**28 else f'{n / 2**20:,.2f} MiB'


def report(plan: Plan) -> None:
  """A table for people, then the plan as one JSON line."""
  rows = [('device', f'{plan.n_devices} × {plan.device}'),
          ('mesh', ' × '.join(f'{a}={s}' for a, s in plan.mesh.items())),
          ('remat policy, microbatches', f'{plan.remat_policy}, {plan.microbatches}'),
          ('arguments / device', readable_bytes(plan.argument_bytes)),
          ('outputs / device', f'{readable_bytes(plan.output_bytes)} ({readable_bytes(plan.alias_bytes)} of them '
                               'in place of donated arguments)'),
          ('temporaries / device', readable_bytes(plan.temp_bytes)),
          ('total / device', f'{readable_bytes(plan.total_bytes)} of {readable_bytes(plan.memory_bytes)}: '
                             + {True: 'fits', False: 'does NOT fit', None: 'device memory unknown'}
                             [plan.fits]),
          ('host memory / device', readable_bytes(plan.host_bytes)),
          ('FLOPs / device / step', f'{plan.flops:.3e} (XLA counts {plan.compiled_flops:.3e}, '
                                    'a scanned layer once)')]
  rows += [(f'{op} in the program', f'{c["count"]} ({readable_bytes(c["bytes"])} of results)')
           for op, c in sorted(plan.collectives.items())]
  metrics.print_table(rows)
  print(json.dumps({**dataclasses.asdict(plan), 'fits': plan.fits}))


def compile_and_plan(setup: Setup, config, devices=None):
  """(compiled train step, its Plan): compiling needs only the abstract state."""
  devices = jax.devices() if devices is None else list(devices)
  compiled = step_lib.compile_train_step(setup, config.batch_size, config.seq_len,
                                         config.loss.z_loss, microbatches=config.microbatches)
  return compiled, make_plan(compiled, setup, config, devices)
