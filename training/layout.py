"""`config.mesh.auto=True`: the mesh shape, remat policy and microbatches that fit the device's
memory and are predicted fastest, found by compiling candidates (from the abstract state: nothing
is allocated; a few seconds each, even for 8B).

Candidates: every data × stage × fsdp × expert × tensor × sequence whose product is the device
count and which the model divides, × (with our kernel and a sequence split) context parallelism
all_gather and ring, × (with config.partition.hierarchical, for a mesh with data > 1 whose
replicas lie within nodes or fill them) plain replicas over data and the config's hierarchical
partition (sharding/hierarchical.py: its int8 settings are the user's to choose, as they change
the numerics), × (on GPUs, where FSDP's gathers cross nodes) weights gathered in their own layer
and a layer early (config.model.prefetch_weights: it pays only where the plan shows it does),
× remat policies full, dots, none, × the fewest microbatches (1, 2, 4, …;
from the stage count up with stages) that fit for that mesh and policy (more only repeat FSDP's
gathers on smaller matmuls). A policy that keeps more activations needs as much memory or more:
its microbatches start from the fewest the policy before it needed, and where that one fits with
none, it is not tried. Doubling the microbatches stops where two compiles show that no number
of them fits: memory is c + a/M, the activations a shrinking with the microbatch. A mesh whose
state alone exceeds the memory, counted from the shards of its abstract state before anything
compiles, is dropped (replicas over `data` of a 46B MoE's state, say), and so is one whose state
a compiled candidate's arguments show does not fit.

Ranked by the time model's prediction of each candidate's compiled program (planning/timing.py):
its recomputation, a pipeline's bubble, the collectives the schedule leaves exposed, all as the
program has them. For devices not in planning/gpus.py the model runs against gpus.NOMINAL's
round figures, and the ranking says it is for ranking only.
"""

import dataclasses
import itertools
import math

import jax

import kernels
from configs.base import CONTEXT_PARALLEL, KEEPS_KERNEL
from planning import communication, gpus, timing
from planning import plan as plan_lib
from sharding import AXES, hierarchical
from sharding.hierarchical import PLAIN, PartitionConfig
import sharding
from configs.base import HOST
from training.programs import compile_and_plan
from configs.base import Run
from training.state import build

POLICIES = ('full', 'dots_except_out', 'dots', 'dots_attention_except_out', 'dots_attention',
            'none')  # keeping the least first


@dataclasses.dataclass
class Candidate:
  mesh: dict
  partition: PartitionConfig
  context_parallel: str
  remat_policy: str
  microbatches: int
  plan: plan_lib.Plan
  predicted: timing.StepTime  # the time model's, for the GPU (or gpus.NOMINAL)
  gpu: gpus.GPU
  prefetch_weights: bool = False

  @property
  def step_s(self) -> float:
    return self.predicted.seconds

  @property
  def mfu(self) -> float:
    return self.plan.flops / self.step_s / self.gpu.peak_bf16_flops


def meshes(n_devices: int):
  """Every {axis: size} over AXES whose sizes multiply to n_devices."""
  divisors = [k for k in range(1, n_devices + 1) if n_devices % k == 0]
  for sizes in itertools.product(divisors, repeat=len(AXES)):
    if math.prod(sizes) == n_devices:
      yield dict(zip(AXES, sizes))


def with_layout(run: Run, mesh: dict, context_parallel: str, policy: str, microbatches: int,
                partition: PartitionConfig = PLAIN, prefetch_weights: bool | None = None) -> Run:
  """`run` laid out so (auto turned off), its attention 'auto' made concrete for its target;
  prefetch_weights None keeps the run's."""
  prefetch = run.model.prefetch_weights if prefetch_weights is None else prefetch_weights
  run = run.replace(mesh={**mesh, 'auto': False}, partition=partition,
                    model={'context_parallel': context_parallel, 'remat_policy': policy,
                           'prefetch_weights': prefetch},
                    microbatches=microbatches)
  return with_attention(run)


def with_attention(run: Run) -> Run:
  """`config.model.attention='auto'` made concrete for programs ranked for the kernels of the
  run's target (planning.target.Target.kernels; a CPU's for None), where cuDNN's compile (not in a
  CPU stand-in for a GPU). On a CPU `xla` (our kernel only interprets there; it runs only the
  ring, context_parallel='ring'); on a GPU the fused kernel that runs this model and mesh
  (kernels.fused_for) which the time model predicts fastest (timing.rank_attention: cuDNN on an
  H100 at head dims 64 and 128, its backward reaching 2.6× ours). A config that names one keeps
  it, and so does one whose mesh the layout search picks (config.mesh.auto): it chooses for each
  candidate (with_layout)."""
  if run.model.attention != 'auto' or run.mesh.auto:
    return run
  cudnn = run.target.on_gpu
  return run.replace(model={'attention': next(
      kernel for kernel, _ in attention_choice(run, run.target.kernels)
      if cudnn or kernel != 'cudnn')})


def attention_choice(run: Run, gpu: gpus.GPU | None) -> list[tuple[str, float]]:
  """[(implementation, its predicted time ÷ the fastest's)] that `with_attention` chooses from,
  fastest first. Without a GPU, xla; but ring attention is our kernel's alone, anywhere."""
  m = run.model
  if gpu is None:
    return [('pallas' if m.context_parallel == 'ring' else 'xla', 1.0)]
  return timing.rank_attention(m.head_dim, m.compute_dtype, run.seq_len, length_split=(
      run.mesh.sequence != 1 or m.context_parallel == 'ring'), gpu=gpu, windows=m.windows,
      lse=m.qk_clip > 0)


def context_choices(run: Run, mesh: dict) -> tuple:
  """Both ways of attending over a sequence split, with our kernel (auto's choice there); else
  the run's own."""
  if (mesh['sequence'] > 1 and run.model.attention in ('auto', *kernels.OURS)
      and not run.model.sliding_window):  # a window has no ring yet
    return CONTEXT_PARALLEL
  return (run.model.context_parallel,)


def partition_choices(run: Run, mesh: dict) -> tuple[PartitionConfig, ...]:
  """Plain replicas over data; and with config.partition.hierarchical, the run's partition
  too, where the mesh has data replicas of a dense model that lie within nodes or fill them."""
  choices, mine = (PLAIN,), run.partition
  if (not mine.hierarchical or mesh['data'] == 1 or not hierarchical.replicas_run_apart(
      run.model.experts, run.model.matmul_precision, run.model.frozen_base)):
    return choices
  try:
    hierarchical.check_nodes(mine, mesh, run.target.gpus_per_node)
  except ValueError:
    return choices
  return choices + (mine,)


def prefetch_choices(run: Run, mesh: dict) -> tuple[bool, ...]:
  """Both ways of gathering FSDP's weights (in their own layer, a layer early) where the gathers
  cross nodes on GPUs, the time model to say which pays (training/programs.py); else the run's."""
  if run.target.on_gpu and communication.spans_nodes(('fsdp',), mesh,
                                                     run.target.gpus_per_node):
    return (False, True)
  return (run.model.prefetch_weights,)


def search(run: Run, log=print) -> list[Candidate]:
  """The candidates that fit on the run's target's devices, fastest predicted first."""
  target = run.target
  if target.memory_bytes is None:
    raise ValueError('config.mesh.auto=True needs the memory to fit: set config.plan.target '
                     f'(one of {sorted(gpus.GPUS)}) or config.plan.memory_gb')
  found = []
  gpu = gpus.find(sharding.local_device(target.devices).device_kind) or gpus.NOMINAL
  for mesh in meshes(len(target.devices)):
    if mesh['stage'] > 1 and run.differentiates_bf16():
      continue  # does not compile yet (settings.check_sections)
    state_fits = _state_fits(run, mesh)
    for context, partition, prefetch in itertools.product(
        context_choices(run, mesh), partition_choices(run, mesh), prefetch_choices(run, mesh)):
      fewest = mesh['stage']  # a pipeline needs a microbatch for every stage
      for policy in POLICIES:
        if policy in KEEPS_KERNEL and with_layout(
            run, mesh, context, 'dots', fewest, partition, prefetch).model.attention == 'xla':
          continue  # no attention kernel whose output to keep: dots' program
        microbatches, fitted, previous = fewest, None, None
        while state_fits and fitted is None:
          candidate = with_layout(run, mesh, context, policy, microbatches, partition, prefetch)
          try:
            setup = build(candidate)
          except sharding.MeshMismatch:  # the model or batch does not divide this way
            break
          compiled, the_plan = compile_and_plan(setup)
          if the_plan.fits:
            found.append(Candidate(mesh, partition, context, policy, microbatches, the_plan,
                                   timing.predict(compiled.as_text(), gpu), gpu, prefetch))
            fitted = microbatches
          state_fits = the_plan.argument_bytes <= the_plan.memory_bytes
          if previous and _floor(previous, the_plan.total_bytes) > the_plan.memory_bytes:
            break  # no number of microbatches fits
          previous, microbatches = the_plan.total_bytes, microbatches * 2
        if fitted is None:  # a policy that keeps more fits no better
          break
        fewest = fitted
    log(f'layout search: {sharding.describe(mesh)}: '
        f'{sum(c.mesh == mesh for c in found)} fitting')
  return sorted(found, key=lambda c: c.step_s)


def _host_tiers(run: Run) -> tuple:
  """(what stays on the devices, the tier settings moved to host memory) to try in turn where
  nothing fits: none where the run places its state itself, keeps it in the step
  (offload_state), or trains what the tiers do not run with (Run.untiered_because)."""
  opt = run.optimizer
  if opt.tiered or opt.offload_state or run.untiered_because():
    return ()
  return (('the optimizer state', ('mu_tier', 'nu_tier')),
          ('the fp32 master weights', ('master_tier', 'mu_tier', 'nu_tier')))


def _floor(at_m: int, at_2m: int) -> float:
  """The least memory any number of microbatches reaches, from the memory at M and at 2M: a
  step holds c + a/M (activations shrink with the microbatch, the rest does not), so
  c = 2·mem(2M) − mem(M)."""
  return 2 * at_2m - at_m


def _state_fits(run: Run, mesh: dict) -> bool:
  """Whether one device's shards of the train state fit the target's memory (True where the
  model or batch does not divide over the mesh: the candidates' own build says why)."""
  try:
    setup = build(with_layout(run, mesh, run.model.context_parallel, 'none',
                              max(1, mesh['stage'])))
  except sharding.MeshMismatch:
    return True  # the candidates' own build says why
  state = sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
              for s in jax.tree.leaves(setup.abstract_state))
  return state <= run.target.memory_bytes


def report(ranked: list[Candidate], limit: int = 10) -> None:
  """The ranking, with each candidate's predicted step and its parts (seconds)."""
  if not ranked:
    return
  gpu = ranked[0].gpu
  print(f'predicted by the time model for {gpu.name}' + (
      ' (round figures for a device not in planning/gpus.py: for ranking only)'
      if gpu is gpus.NOMINAL else ', not measured'))
  partitions = any(c.partition.hierarchical for c in ranked)
  prefetch = any(c.prefetch_weights for c in ranked)
  print(f'{"rank":>4}  {"×".join(AXES):<41}{"context":<11}'
        + (f'{"partition":<42}' if partitions else '') + (f'{"weights":<8}' if prefetch else '')
        + f'{"remat":<6}{"micro":>6}'
        f'{"GiB/device":>11}{"step s":>8}{"MFU":>7}{"GEMM s":>8}{"attn s":>8}{"other s":>8}'
        f'{"comm s":>8}')
  for i, c in enumerate(ranked[:limit], 1):
    mesh = '×'.join(str(c.mesh[a]) for a in AXES)
    context = c.context_parallel if c.mesh['sequence'] > 1 else '-'
    parts = c.predicted.breakdown
    other = parts['fusion'] + parts['other'] + parts['launch']
    partition = (f'{plan_lib.partition_name(c.partition):<42}'
                 if partitions else '')
    weights = f'{"early" if c.prefetch_weights else "own":<8}' if prefetch else ''
    print(f'{i:>4}  {mesh:<41}{context:<11}{partition}{weights}{c.remat_policy:<6}'
          f'{c.microbatches:>6}'
          f'{c.plan.total_bytes / 2**30:>11.3g}{c.step_s:>8.3g}'
          f'{"-" if c.gpu is gpus.NOMINAL else f"{c.mfu:.1%}":>7}'
          f'{parts["gemm"]:>8.3g}{parts["attention"]:>8.3g}{other:>8.3g}'
          f'{parts["communication"]:>8.3g}')
  if len(ranked) > limit:
    print(f'… and {len(ranked) - limit} more that fit')


def choose(run: Run, log=print) -> tuple[Run, list[Candidate]]:
  """(`run` with the best layout's mesh, remat policy, microbatches and weight prefetch for its
  target, auto turned off; the ranking). Where nothing fits with the optimizer state on the
  devices, and the run leaves it to them (its tiers all `device`), it searches again with the
  state in host memory (training/tiers.py): Adam's moments first, which changes no number, then
  the master weights too, whose devices' copy is then in the compute dtype."""
  ranked, tiers = search(run, log), _host_tiers(run)
  for kept, moved in tiers:
    if ranked:
      break
    log(f'layout search: nothing fits with {kept} on the devices; again with '
        + ', '.join(f'config.optimizer.{name}=host' for name in moved))
    tiered = run.replace(optimizer={name: HOST for name in moved})
    ranked = search(tiered, log)
    run = tiered if ranked else run
  if not ranked:
    raise ValueError('config.mesh.auto: no mesh shape × remat policy × microbatches fits'
                     + (', even with the optimizer state in host memory' if tiers else '')
                     + '; use more devices, or a smaller config.batch_size or config.seq_len')
  report(ranked)
  best = ranked[0]
  return with_layout(run, best.mesh, best.context_parallel, best.remat_policy,
                     best.microbatches, best.partition, best.prefetch_weights), ranked
