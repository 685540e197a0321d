"""`config.mesh.auto=True`: the mesh shape, remat policy and microbatches that fit the device's
memory and are estimated fastest, found by compiling candidates (from the abstract state: nothing
is allocated; a few seconds each, even for 8B).

Candidates: every data × fsdp × tensor × sequence whose product is the device count and which the
model divides, × remat policies none, dots, full, × the fewest microbatches (1, 2, 4, …) that fit
for that mesh and policy (more only repeat FSDP's gathers on smaller matmuls). A mesh whose state
alone (the step's arguments) exceeds the memory is dropped without trying the rest.

Step-time estimate, deliberately simple (no overlap of compute and communication assumed):
  compute = model FLOPs per device (planning/flops.py) × recompute / the device's bf16 peak,
            recompute = 1 (none), 1.1 (dots: attention and elementwise ops again), 4/3 (full)
  comm    = bytes each device moves per step / the device's link bandwidth (per direction)
  (peak and link from planning/gpus.py; other devices are ranked at 100 TFLOP/s and 100 GB/s)
    fsdp (×sequence, which shards the same dim), g = f·s:  weights gathered forward and
              backward per microbatch, again when `full` recomputes: (2|3)·M·P·c/t·(g−1)/g,
              plus fp32 gradients reduce-scattered: 4·P/t·(g−1)/g
    data:     fp32 gradient all-reduce: 2·4·P/(t·g)·(d−1)/d
    tensor:   activation all-reduces, 4 a layer (6 under full): 2·(t−1)/t·b·L/s·D·c each
    sequence: keys and values gathered forward, reduce-scattered backward: 4·b·L·K·H·c·(s−1)/s
              a layer
  with P parameters, c bytes per compute value, M microbatches, b = B/(d·f·M) rows per device.
"""

import dataclasses
import itertools
import math

from model import ModelConfig
from planning import gpus
from planning import plan as plan_lib
from sharding import AXES
import sharding
from training.state import build, param_count

POLICIES = ('none', 'dots', 'full')
RECOMPUTE = {'none': 1.0, 'dots': 1.1, 'full': 4 / 3}
UNKNOWN_DEVICE = (100e12, 100e9)  # FLOP/s and link bytes/s assumed for other devices (ranking only)


@dataclasses.dataclass
class Candidate:
  mesh: dict
  remat_policy: str
  microbatches: int
  plan: plan_lib.Plan
  compute_s: float
  comm_s: float

  @property
  def step_s(self) -> float:
    return self.compute_s + self.comm_s


def meshes(n_devices: int):
  """Every {axis: size} over AXES whose sizes multiply to n_devices."""
  divisors = [k for k in range(1, n_devices + 1) if n_devices % k == 0]
  for sizes in itertools.product(divisors, repeat=len(AXES)):
    if math.prod(sizes) == n_devices:
      yield dict(zip(AXES, sizes))


def comm_bytes(cfg: ModelConfig, params: int, mesh: dict, policy: str, microbatches: int,
               batch_size: int, seq_len: int) -> float:
  d, f, t, s = (mesh[a] for a in AXES)
  g, c, M = f * s, cfg.dtype.itemsize, microbatches
  rows = batch_size / (d * f * M)
  full = policy == 'full'
  fsdp = (3 if full else 2) * M * params * c / t * (g - 1) / g + 4 * params / t * (g - 1) / g
  data = 2 * 4 * params / (t * g) * (d - 1) / d
  tensor = (6 if full else 4) * cfg.n_layers * M * 2 * (t - 1) / t * rows * seq_len / s \
      * cfg.d_model * c
  sequence = 4 * cfg.n_layers * M * rows * seq_len * cfg.n_kv_heads * cfg.head_dim * c \
      * (s - 1) / s
  return fsdp + data + tensor + sequence


def estimate(plan: plan_lib.Plan, setup, config) -> tuple[float, float]:
  """(compute seconds, communication seconds) of one step, per the module's formula."""
  gpu = gpus.find(plan.device)
  peak, link = (gpu.peak_bf16_flops, gpu.link_bandwidth) if gpu else UNKNOWN_DEVICE
  compute = plan.flops * RECOMPUTE[plan.remat_policy] / peak
  moved = comm_bytes(setup.model_cfg, param_count(setup.abstract_state.params), plan.mesh,
                     plan.remat_policy, plan.microbatches, config.batch_size, config.seq_len)
  return compute, moved / link


def with_layout(config, mesh: dict, policy: str, microbatches: int):
  config = config.copy_and_resolve_references()
  config.mesh.update(mesh)
  config.model.remat_policy, config.microbatches = policy, microbatches
  return config


def search(config, devices, log=print) -> list[Candidate]:
  """The candidates that fit, fastest estimate first."""
  if plan_lib.memory_budget(config, devices)[0] is None:
    raise ValueError('config.mesh.auto=True needs the memory to fit: set config.plan.target '
                     f'(one of {sorted(gpus.GPUS)}) or config.plan.memory_gb')
  found = []
  for mesh in meshes(len(devices)):
    state_fits = True
    for policy in POLICIES:
      microbatches = 1
      while state_fits:
        candidate = with_layout(config, mesh, policy, microbatches)
        try:
          setup = build(candidate, devices)
        except sharding.MeshMismatch:  # the model or batch does not divide this way
          break
        _, the_plan = plan_lib.compile_and_plan(setup, candidate)
        if the_plan.fits:
          found.append(Candidate(mesh, policy, microbatches, the_plan,
                                 *estimate(the_plan, setup, candidate)))
          break
        state_fits = the_plan.argument_bytes <= the_plan.memory_bytes
        microbatches *= 2
    log(f'layout search: {sharding.describe(mesh)}: '
        f'{sum(c.mesh == mesh for c in found)} fitting')
  return sorted(found, key=lambda c: c.step_s)


def report(ranked: list[Candidate], limit: int = 10) -> None:
  print(f'{"rank":>4}  {"data×fsdp×tensor×sequence":<26}{"remat":<6}{"micro":>6}'
        f'{"GiB/device":>12}{"compute s":>11}{"comm s":>9}{"step s":>9}')
  for i, c in enumerate(ranked[:limit], 1):
    mesh = '×'.join(str(c.mesh[a]) for a in AXES)
    print(f'{i:>4}  {mesh:<26}{c.remat_policy:<6}{c.microbatches:>6}'
          f"{c.plan.total_bytes / 2**30:>12.3g}{c.compute_s:>11.3g}{c.comm_s:>9.3g}{c.step_s:>9.3g}")
  if len(ranked) > limit:
    print(f'… and {len(ranked) - limit} more that fit')


def choose(config, devices, log=print):
  """`config` with the best layout's mesh, remat policy and microbatches (auto turned off)."""
  ranked = search(config, devices, log)
  if not ranked:
    raise ValueError('config.mesh.auto: no mesh shape × remat policy × microbatches fits; '
                     'use more devices, a smaller config.batch_size or config.seq_len, or '
                     'config.optimizer.offload_state=True')
  report(ranked)
  best = ranked[0]
  chosen = with_layout(config, best.mesh, best.remat_policy, best.microbatches)
  chosen.mesh.auto = False
  return chosen, ranked
