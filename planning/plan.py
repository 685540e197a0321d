"""Plans a run before anything is allocated: the train step compiled ahead of time for the
configured mesh from the abstract state, and what the compiled program says about it.

  python train.py --config=configs/llama.py:8b --config.dry_run=True --config.plan.target=H100

Per device: argument bytes (parameters, optimizer state, batch), output bytes, temporaries
(activations, gradients, workspace), total = arguments + outputs + temporaries − aliased (the
donated state is updated in place); FLOPs per step (the model's, planning/flops.py, as MFU counts
them; on CPU also XLA's own count, which counts a scanned layer once; the GPU compiler gives none);
for a program compiled for a GPU of planning/gpus.py, the time model's prediction of its step
(planning/timing.py: step time, tokens/s a device, MFU, its parts and costliest kernels);
the collectives one step runs, by kind, with the bytes each device sends (sharding/collectives.py:
a layer's run once per layer), and how many of those bytes cross between nodes (the target GPU's
gpus_per_node to a node, filled in the mesh's device order, as a multi-process job orders them).

What the step is compiled for is the run's planning.target.Target: the devices here, or
compile-only GPUs of config.plan.target (the GPU compiler's own figures), or, without the GPU
compiler, the devices here as a stand-in, which the plan says: arguments are exact, but
temporaries follow the CPU compiler (which, for one, keeps collectives in fp32). A plan fits when
its total is within the target's memory (planning/target.py says where that figure comes from).
"""

import dataclasses
import json
import math

import jax

from configs.base import NEWTON_SCHULZ, ModelConfig, OptimizerConfig, PartitionConfig
import kernels
from planning import flops as flops_lib
from planning import gpu_compiler, gpus, offload, timing
from planning.target import Target
from reporting import metrics
from sharding import collectives, hlo as hlo_lib
import sharding


@dataclasses.dataclass
class Plan:
  device: str  # what it plans for: config.plan.target, or the device kind here
  compiled_for: str  # the device kind whose compiler made these figures
  deviceless: bool  # compiled for GPUs this process does not have
  n_devices: int
  mesh: dict
  remat_policy: str
  attention: str
  attention_ranking: list  # [(fused kernel, predicted time ÷ the fastest's)] for a GPU, else []
  context_parallel: str
  microbatches: int
  virtual_stages: int
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  total_bytes: int
  host_bytes: int  # in pinned host memory (offloaded optimizer state or activations), if reported
  flops: float  # per device per step, the model's (planning/flops.py)
  attention_flops: float  # the part of `flops` that attention does
  matmul_flops: float  # the compiled program's dots, each run counted (timing's gemm_flops)
  compiled_flops: float | None  # XLA's cost analysis of the per-device program (CPU only)
  collectives: dict  # {op: {'count', 'bytes', 'overlapped_bytes', 'by_dtype'}} (collectives.summary)
  across_nodes_bytes: int  # of those bytes, what collectives spanning nodes send (gpus_per_node)
  gpus_per_node: int
  memory_bytes: int | None  # what the target device offers a run; None if unknown
  memory_source: str  # where memory_bytes comes from
  time: dict | None = None  # the time model's prediction of this program (planning/timing.py),
                            # for a GPU of planning/gpus.py; None for other devices
  partition: str = 'flat'  # how parameters cross data (config.partition): flat, or hierarchical
                           # with what crosses in int8
  param_bytes: int = 0  # of argument_bytes: the parameters a device holds (its shards)
  optimizer_bytes: int = 0  # and the optimizer state (under LoRA, the adapters' alone)
  prefetch_weights: bool = False  # each layer's weight gathers start a layer early
                                  # (config.model.prefetch_weights, training/programs.py)
  scheduler_memory: float | None = None  # GPUs: what XLA's scheduler planned within, as a share
                                         # of the memory beside the step's inputs and outputs
  tiers: dict | None = None  # the optimizer state off the devices (planning/offload.py: TierCost)
  newton_schulz: dict | None = None  # Muon's iterations: {'flops', 'seconds'} a device, the
                                     # time model's; None without Muon
  update_bytes: int = 0  # with tiers, a device's peak while the update runs after the step: the
                         # step's inputs and outputs (the gradients), the new parameters (in
                         # place of the old copy where the master weights are off the devices),
                         # three groups' shares

  @property
  def collective_bytes(self) -> int:
    """Bytes each device sends per step, over every collective."""
    return sum(c['bytes'] for c in self.collectives.values())

  @property
  def peak_bytes(self) -> int:
    """A device's peak over the step and, with tiers, the update after it."""
    return max(self.total_bytes, self.update_bytes)

  @property
  def fits(self) -> bool | None:
    return None if self.memory_bytes is None else self.peak_bytes <= self.memory_bytes

  def as_dict(self) -> dict:
    """The plan as its JSON line has it."""
    return {**dataclasses.asdict(self), 'fits': self.fits}


@dataclasses.dataclass(frozen=True)
class Step:
  """What a compiled train step is of: the model, its batch and where its state lies."""
  model: ModelConfig
  optimizer: OptimizerConfig
  partition: PartitionConfig
  target: Target  # what the programs compile for
  mesh: jax.sharding.Mesh
  batch_size: int
  seq_len: int
  microbatches: int
  preference: bool  # DPO: a reference model's forward too
  abstract_state: object  # what the devices hold between steps (params, opt_state)
  checkpoint_params: object  # the parameters as a checkpoint holds them (the tiers' master)


def make_plan(compiled, step: Step) -> Plan:
  """The Plan of `compiled`, the train step `step` describes, for its target."""
  target = step.target
  devices = list(step.mesh.devices.flat)
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per program
  n = step.mesh.size
  tokens = step.batch_size * step.seq_len
  kind = sharding.local_device(devices).device_kind
  hlo = compiled.as_text()
  gpu = gpus.find(kind)  # the compiled program's, which the time model describes
  cfg = step.model
  flops = flops_lib.flops_per_token(cfg, step.seq_len, reference=step.preference) * tokens / n
  attention_flops = flops_lib.attention_flops_per_token(cfg, step.seq_len) * tokens / n
  predicted = timing.predict(hlo, gpu or gpus.NOMINAL)
  attention_ranking = (timing.rank_attention(cfg.head_dim, cfg.compute_dtype, step.seq_len,
                                             length_split=step.mesh.shape['sequence'] > 1,
                                             gpu=gpu, windows=cfg.windows,
                                             lse=cfg.qk_clip > 0) if gpu else [])
  tiers = offload.cost(step.optimizer, step.checkpoint_params, devices, gpu,
                       target.gpus_per_node)
  on_gpu = devices[0].platform == 'gpu'  # XLA's GPU options apply (training/programs.py)
  time = predicted_time(predicted, gpu, tokens / n, flops, tiers)
  param_bytes = _device_bytes(step.abstract_state.params)
  update_bytes = 0
  if tiers:
    owned_share = tiers.owned_bytes / max(tiers.node_bytes, 1)
    # tiers train every parameter; off the devices, the master weights' copy there is freed
    # before the update makes the new one (training/tiers.py: Engine.__call__)
    new_copy = param_bytes if step.optimizer.master_on_devices else 0
    update_bytes = (memory.argument_size_in_bytes + memory.output_size_in_bytes + new_copy
                    + int(3 * tiers.group_bytes * owned_share))
  return Plan(
      device=target.name, compiled_for=kind,
      deviceless=gpu_compiler.is_deviceless(devices[0]), n_devices=n,
      mesh=dict(step.mesh.shape), remat_policy=cfg.remat_policy,
      attention=cfg.attention, attention_ranking=attention_ranking,
      context_parallel=cfg.context_parallel,
      microbatches=step.microbatches, virtual_stages=cfg.virtual_stages,
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      temp_bytes=memory.temp_size_in_bytes, alias_bytes=memory.alias_size_in_bytes,
      total_bytes=(memory.argument_size_in_bytes + memory.output_size_in_bytes
                   + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
      host_bytes=(memory.host_argument_size_in_bytes + memory.host_output_size_in_bytes
                  + memory.host_temp_size_in_bytes - memory.host_alias_size_in_bytes),
      flops=flops, attention_flops=attention_flops,
      matmul_flops=predicted.gemm_flops,
      compiled_flops=float(cost['flops']) if cost and 'flops' in cost else None,
      collectives=collectives.summary(hlo),
      across_nodes_bytes=collectives.crossing_bytes(
          hlo, lambda device: device // target.gpus_per_node),
      gpus_per_node=target.gpus_per_node, partition=partition_name(step.partition),
      memory_bytes=target.memory_bytes, memory_source=target.memory_source,
      time=time, param_bytes=param_bytes,
      optimizer_bytes=_device_bytes(step.abstract_state.opt_state),
      prefetch_weights=on_gpu and cfg.prefetch_weights,
      scheduler_memory=cfg.scheduler_memory if on_gpu else None,
      tiers=dataclasses.asdict(tiers) if tiers else None, update_bytes=update_bytes,
      newton_schulz=newton_schulz(hlo, predicted) if step.optimizer.name == 'muon' else None)


def newton_schulz(hlo_text: str, predicted: timing.StepTime) -> dict:
  """Muon's iterations in the program (its kernels, by their name scope): their GEMM FLOPs a
  device and their time, the time model's (communication apart)."""
  scoped = {inst.name for lines in hlo_lib.parse(hlo_text)[0].values() for line in lines
            if (inst := hlo_lib.instruction(line)) and NEWTON_SCHULZ in inst.op_name}
  mine = [k for k in predicted.kernels if k.name in scoped]
  return {'flops': sum(k.flops * k.runs for k in mine if k.part == 'gemm'),
          'seconds': sum(k.seconds * k.runs for k in mine)}


def _device_bytes(abstract) -> int:
  """What one device holds of `abstract` (ShapeDtypeStructs with shardings), wherever it lives."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(abstract))


def partition_name(partition) -> str:
  """'flat', or 'hierarchical' with what crosses data in int8: 'hierarchical, int8 weights'."""
  if not partition.hierarchical:
    return 'flat'
  int8 = [part for part in ('weights', 'gradients') if getattr(partition, part) == 'int8']
  return 'hierarchical' + (f', int8 {" and ".join(int8)}' if int8 else '')


def predicted_time(predicted: timing.StepTime, gpu: gpus.GPU | None, tokens: float,
                   flops: float, tiers: offload.TierCost | None = None) -> dict | None:
  """The time model's step for a program compiled for `gpu`, with the tokens/s a device and MFU
  it implies (`tokens` and `flops` per device); None for a device not in planning/gpus.py, whose
  program the model does not describe. With the optimizer state on tiers, the update after the
  program is a part of the step ('tiers', planning/offload.py)."""
  if gpu is None:
    return None
  table = predicted.table()
  if tiers:
    seconds = table['seconds'] + tiers.update_s
    table['breakdown'] = {part: {'s': t['s'], 'share': t['s'] / seconds}
                          for part, t in table['breakdown'].items()}
    table['breakdown']['tiers'] = {'s': tiers.update_s, 'share': tiers.update_s / seconds}
    table['seconds'] = seconds
  return {**table, 'gpu': gpu.name,
          'tokens_per_s_per_device': tokens / table['seconds'],
          'mfu': flops / table['seconds'] / gpu.peak_bf16_flops}


def check_fits(plan: Plan) -> None:
  """Before a real run allocates: the compiled step's memory within the device's."""
  if plan.fits is False:
    fused = ('use a fused attention that never stores the [L, S] scores (config.model.attention='
             'cudnn, pallas or hopper), ' if plan.attention == 'xla' else '')
    update = (f'; the update after it, the optimizer state streamed from its tiers, '
              f'{readable_bytes(plan.update_bytes)}' if plan.update_bytes > plan.total_bytes
              else '')
    raise ValueError(
        f'the train step needs {readable_bytes(plan.total_bytes)} per device (arguments '
        f'{readable_bytes(plan.argument_bytes)}, temporaries {readable_bytes(plan.temp_bytes)}'
        f'{update}) '
        f'but a {plan.device} has {readable_bytes(plan.memory_bytes)} ({plan.memory_source}); '
        f'{fused}recompute more (config.model.remat_policy={plan.remat_policy!r} → full), shard '
        'the state over more devices (config.mesh.fsdp), or split the batch (config.microbatches='
        f'{plan.microbatches} → {plan.microbatches * 2}). `--config.dry_run=True` shows the plan '
        'without running')


def readable_bytes(n: int | None) -> str:
  if n is None:
    return 'unknown'
  return f'{n / 2**30:,.2f} GiB' if n >= 2**28 else f'{n / 2**20:,.2f} MiB'


def compiled_for(plan: Plan, gpu: gpus.GPU | None) -> str:
  """The 'compiled for' line (`gpu`: the plan's device, if planning/gpus.py knows it): the GPU
  compiler without a GPU, the devices here, or a stand-in."""
  if plan.deviceless:
    return f'{plan.compiled_for} (deviceless: the GPU compiler, no GPU)'
  if gpu and plan.compiled_for != gpu.device_kind:
    return (f'{plan.compiled_for}, a stand-in for {plan.device}: temporaries approximate; '
            f'`{gpu_compiler.INSTALL}` compiles for {plan.device} itself')
  return plan.compiled_for


def _stand_in(plan: Plan, gpu: gpus.GPU | None) -> str:
  """What a verdict from a CPU stand-in's compile is worth, and how to get the GPU's own."""
  if plan.deviceless or not gpu or plan.compiled_for == gpu.device_kind:
    return ''
  return (f' (by a {plan.compiled_for} stand-in, whose temporaries are not the GPU\'s: '
          f'`{gpu_compiler.INSTALL}` gives the {plan.device}\'s own)')


def report(plan: Plan) -> None:
  """A table for people, then the plan as one JSON line."""
  gpu = gpus.find(plan.device)  # None: a device planning/gpus.py does not know
  xla_flops = ('' if plan.compiled_flops is None else
               f' (XLA counts {plan.compiled_flops:.3e}, a scanned layer once)')
  split = plan.mesh.get('sequence', 1) > 1 and plan.attention in kernels.OURS
  context = f' ({plan.context_parallel} over sequence)' if split else ''
  ranking = plan.attention_ranking and (
      ', '.join(f'{k} {r:.2f}×' for k, r in plan.attention_ranking)
      + " the fastest's time (config.model.attention='auto' takes the first)")
  rows = [('device', f'{plan.n_devices} × {plan.device}'),
          ('compiled for', compiled_for(plan, gpu)),
          ('mesh', sharding.describe(plan.mesh)
           + ('' if plan.partition == 'flat' else f' ({plan.partition} over data)')),
          ('attention, remat policy', f'{plan.attention}{context}, {plan.remat_policy}'),
          *([('attention, time model', ranking)] if ranking else []),
          ('microbatches', str(plan.microbatches) + (
              f' through {plan.mesh["stage"]} stages × {plan.virtual_stages} virtual'
              if plan.mesh.get('stage', 1) > 1 else '')),
          *([('weight gathers', "a layer early (XLA's collective pipeliner, "
                                'config.model.prefetch_weights)')] if plan.prefetch_weights else []),
          *([('XLA scheduler', f'plans within {plan.scheduler_memory:.0%} of the memory beside '
                               'inputs and outputs (config.model.scheduler_memory)')]
            if plan.scheduler_memory not in (None, gpus.XLA_SCHEDULER_MEMORY) else []),
          ('arguments / device', readable_bytes(plan.argument_bytes)),
          ('state / device', f'parameters {readable_bytes(plan.param_bytes)}, optimizer '
                             f'{readable_bytes(plan.optimizer_bytes)} (wherever they live)'),
          ('outputs / device', f'{readable_bytes(plan.output_bytes)} ({readable_bytes(plan.alias_bytes)} of them '
                               'in place of donated arguments)'),
          ('temporaries / device', readable_bytes(plan.temp_bytes)),
          ('total / device', f'{readable_bytes(plan.total_bytes)} of {readable_bytes(plan.memory_bytes)}: '
                             + {True: 'fits', False: 'does NOT fit', None: 'device memory unknown'}
                             [plan.fits] + _stand_in(plan, gpu)),
          *tier_rows(plan),
          ('memory available', plan.memory_source),
          ('host memory / device', readable_bytes(plan.host_bytes)),
          ('FLOPs / device / step', f'{plan.flops:.3e}{xla_flops}'),
          ('matmul FLOPs compiled', f'{plan.matmul_flops:.3e} (each run counted, recomputation '
                                    'included; attention kernels not)'),
          *([("Muon's Newton–Schulz", f'{plan.newton_schulz["flops"]:.3e} FLOPs a device, '
                                      f'{readable_seconds(plan.newton_schulz["seconds"])} of '
                                      'kernels (predicted), in the figures above')]
            if plan.newton_schulz else [])]
  rows += [(f'{op} / step', f'{c["count"]} runs, {readable_bytes(c["bytes"])} sent per device, '
            f'{c["overlapped_bytes"] / max(c["bytes"], 1):.0%} of it while computing')
           for op, c in sorted(plan.collectives.items())]
  if plan.n_devices > plan.gpus_per_node:
    rows.append(('across nodes / step', f'{readable_bytes(plan.across_nodes_bytes)} sent per '
                 'device by collectives spanning nodes, '
                 f'{readable_bytes(plan.collective_bytes - plan.across_nodes_bytes)} inside '
                 f'nodes of {plan.gpus_per_node}'))
  rows += time_rows(plan.time)
  metrics.print_table(rows)
  print(json.dumps(plan.as_dict()))


# The parts whose efficiencies no GPU has measured yet (planning/gpus.py), said beside their time.
UNFITTED = {'communication': 'collectives at priors (NCCL on NVLink and NICs): one GPU cannot '
                             'time them'}
PART_NAMES = {'gemm': 'GEMMs', 'attention': 'attention', 'fusion': 'other fusions',
              'other': 'other kernels', 'communication': 'exposed communication',
              'launch': 'launch gaps',
              'tiers': 'the optimizer state streamed (its tiers, after the step)'}


def tier_rows(plan: Plan) -> list[tuple[str, str]]:
  """The rows of the optimizer state's tiers: where it lives, what each tier holds, the update's
  peak and its traffic."""
  t = plan.tiers
  if not t:
    return []
  seconds = lambda s: 'not predicted' if s is None else readable_seconds(s)
  where = ', '.join(f'{kind} {tier}' for kind, tier in t['placement'].items())
  return [('optimizer state tiers', where),
          ('  held / node', f'host memory {readable_bytes(t["host_bytes_per_node"])}, NVMe '
                            f'{readable_bytes(t["nvme_bytes_per_node"])}'),
          ('  update after the step', f'peak {readable_bytes(plan.update_bytes)} / device; the '
                                      f'busiest device reads and writes '
                                      f'{readable_bytes(t["pcie_bytes"])} over PCIe '
                                      f'({seconds(t["pcie_s"])}), a node its NVMe '
                                      f'{readable_bytes(t["nvme_bytes_per_node"])} each way '
                                      f'({seconds(t["nvme_s"])} at '
                                      f'{offload.NVME_BANDWIDTH / 1e9:.0f} GB/s)')]


def time_rows(time: dict | None, kernels: int = 10) -> list[tuple[str, str]]:
  """The plan's rows for the time model's prediction: the step, its parts, the costliest kernels."""
  if time is None:
    return [('step time', 'not predicted: the time model describes programs compiled for the '
                          'GPUs of planning/gpus.py')]
  rows = [('step time (predicted)', f'{readable_seconds(time["seconds"])}, '
                                    f'{time["tokens_per_s_per_device"]:,.0f} tokens/s a device, '
                                    f'MFU {time["mfu"]:.1%}: the time model of this program on '
                                    f'{time["gpu"]}, not a measurement')]
  rows += [(f'  {PART_NAMES[part]}', f'{readable_seconds(t["s"])} ({t["share"]:.0%})'
            + (f' of {readable_seconds(time["communication_s"])} in all'
               if part == 'communication' else '')
            + (f'; {UNFITTED[part]}' if part in UNFITTED and t['s'] else '')
            + ('; our grouped matmul at a prior, not yet timed' if part == 'gemm' and any(
                'grouped_matmul' in k['op'] for k in time['kernels']) else ''))
           for part, t in time['breakdown'].items()]
  rows += [(f'  costliest #{i}', f'{readable_seconds(k["s"])} {k["part"]}: {k["op"]} '
                                 f'({k["name"]}) × {k["runs"]}')
           for i, k in enumerate(time['kernels'][:kernels], 1)]
  return rows


def readable_seconds(s: float) -> str:
  return f'{s:,.3f} s' if s >= 1 else f'{s * 1e3:,.2f} ms'
