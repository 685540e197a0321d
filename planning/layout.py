"""`config.mesh.auto=True`: the mesh shape, remat policy and microbatches that fit the device's
memory and are estimated fastest, found by compiling candidates (from the abstract state: nothing
is allocated; a few seconds each, even for 8B).

Candidates: every data × stage × fsdp × tensor × sequence whose product is the device count and
which the model divides, × (with our kernel and a sequence split) context parallelism all_gather
and ring, × remat policies none, dots, full, × the fewest microbatches (1, 2, 4, …; from the stage
count up with stages) that fit for that mesh and policy (more only repeat FSDP's gathers on
smaller matmuls). A mesh whose state alone (the step's arguments) exceeds the memory is dropped
without trying the rest.

Step-time estimate, deliberately simple (no overlap of compute and communication assumed):
  compute = (model FLOPs per device (planning/flops.py) + what the program recomputes) / the
            device's bf16 peak; the recomputation is measured: the candidate's compiled matmul
            FLOPs (flops.compiled_matmul_flops, every run counted) less the formula's, so XLA's
            own rematerialisation counts too, and so do a pipeline's bubble (every stage runs its
            layers at every tick of the schedule) and the embedding and head each stage computes;
            plus, under a remat policy, a fused attention's forward again (its kernels are not
            dots)
  comm    = the bytes each device sends per step in the candidate's compiled program (every
            collective, each run counted: sharding/collectives.py) over the device's bandwidth
            (per direction): those of collectives spanning nodes over the node's network, the
            rest over the links within a node; except a ring's hops, which are sent while the
            attention kernels run (kernels/context_parallel.py): only what outlasts the
            attention's share of compute counts
  (peak, link and node bandwidth from planning/gpus.py; other devices are ranked at 100 TFLOP/s
  and 100 GB/s, as one node)
"""

import dataclasses
import itertools
import math

from model.config import CONTEXT_PARALLEL
from planning import gpus
from planning import plan as plan_lib
from sharding import AXES
import sharding
from training.state import build

POLICIES = ('none', 'dots', 'full')
UNKNOWN_DEVICE = (100e12, 100e9)  # FLOP/s and link bytes/s assumed for other devices (ranking only)


@dataclasses.dataclass
class Candidate:
  mesh: dict
  context_parallel: str
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


def recomputed_flops(plan: plan_lib.Plan) -> float:
  """FLOPs per device that `plan`'s program runs again, per the module docstring."""
  dense = plan.flops - plan.attention_flops
  if plan.attention == 'xla':  # its dots are in the program, whole [L, S]: twice the causal count
    return max(0.0, plan.matmul_flops - dense - 2 * plan.attention_flops)
  again = 0.0 if plan.remat_policy == 'none' else plan.attention_flops / 3  # forward of fwd+bwd
  return max(0.0, plan.matmul_flops - dense) + again


def estimate(plan: plan_lib.Plan, recomputed: float = 0.0) -> tuple[float, float]:
  """(compute seconds, communication seconds) of one step, per the module's formula."""
  gpu = gpus.find(plan.device)
  peak, link = (gpu.peak_bf16_flops, gpu.link_bandwidth) if gpu else UNKNOWN_DEVICE
  node = gpu.node_bandwidth if gpu else link
  hidden = 0.0
  if plan.context_parallel == 'ring':
    ring = plan.collectives.get('collective-permute', {}).get('bytes', 0)
    again = 0.0 if plan.remat_policy == 'none' else 1 / 3  # the forward, run again
    hidden = min(ring / link, plan.attention_flops * (1 + again) / peak)
  within = plan.collective_bytes - plan.across_nodes_bytes
  return (plan.flops + recomputed) / peak, within / link + plan.across_nodes_bytes / node - hidden


def with_layout(config, mesh: dict, context_parallel: str, policy: str, microbatches: int):
  config = config.copy_and_resolve_references()
  config.mesh.update(mesh)
  config.model.context_parallel = context_parallel
  config.model.remat_policy, config.microbatches = policy, microbatches
  return config


def context_choices(config, mesh: dict) -> tuple:
  """Both ways of attending over a sequence split, with our kernel; else the config's own."""
  if mesh['sequence'] > 1 and config.model.attention == 'pallas':
    return CONTEXT_PARALLEL
  return (config.model.context_parallel,)


def search(config, devices, log=print) -> list[Candidate]:
  """The candidates that fit, fastest estimate first."""
  if plan_lib.memory_budget(config, devices)[0] is None:
    raise ValueError('config.mesh.auto=True needs the memory to fit: set config.plan.target '
                     f'(one of {sorted(gpus.GPUS)}) or config.plan.memory_gb')
  found = []
  for mesh in meshes(len(devices)):
    state_fits = True
    for context, policy in itertools.product(context_choices(config, mesh), POLICIES):
      microbatches = mesh['stage']  # a pipeline needs a microbatch for every stage
      while state_fits:
        candidate = with_layout(config, mesh, context, policy, microbatches)
        try:
          setup = build(candidate, devices)
        except sharding.MeshMismatch:  # the model or batch does not divide this way
          break
        _, the_plan = plan_lib.compile_and_plan(setup, candidate)
        if the_plan.fits:
          found.append(Candidate(mesh, context, policy, microbatches, the_plan,
                                 *estimate(the_plan, recomputed_flops(the_plan))))
          break
        state_fits = the_plan.argument_bytes <= the_plan.memory_bytes
        microbatches *= 2
    log(f'layout search: {sharding.describe(mesh)}: '
        f'{sum(c.mesh == mesh for c in found)} fitting')
  return sorted(found, key=lambda c: c.step_s)


def report(ranked: list[Candidate], limit: int = 10) -> None:
  print(f'{"rank":>4}  {"×".join(AXES):<32}{"context":<11}{"remat":<6}{"micro":>6}'
        f'{"GiB/device":>12}{"compute s":>11}{"comm s":>9}{"step s":>9}')
  for i, c in enumerate(ranked[:limit], 1):
    mesh = '×'.join(str(c.mesh[a]) for a in AXES)
    context = c.context_parallel if c.mesh['sequence'] > 1 else '-'
    print(f'{i:>4}  {mesh:<32}{context:<11}{c.remat_policy:<6}{c.microbatches:>6}'
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
  chosen = with_layout(config, best.mesh, best.context_parallel, best.remat_policy,
                       best.microbatches)
  chosen.mesh.auto = False
  return chosen, ranked
