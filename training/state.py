"""From a run to a sharded train state, in the one-way order run → mesh → abstract state →
shardings → initialised state: resumed from the workdir's checkpoints, or started from what the run
names (a meshlm run's parameters, a Hugging Face checkpoint), or fresh; every checkpoint it would
read is checked first (`check_checkpoints`), before data or memory are touched. What is wrong with
a run on its devices (the mesh against the model and batch, kernels and memories the devices lack)
is found here, once, before anything is compiled or allocated; everything else was found by
training/settings.py."""

import dataclasses
import warnings

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from configs import effects
from data import tokenizers
from interop import huggingface
from kernels.attention import length_tile
from model import ModelConfig, Transformer
from model.layers import (ADDED, Draft, LoRA, adapters_merged, added_kind, is_added,
                          split_adapters)
from planning import gpus
from planning import target as target_lib
from runtime import checkpoint as checkpoint_lib
import sharding
from sharding import hierarchical
from training import optimizer
from training.optimizer import base_params, trained
from configs.base import HF, RUN, Run


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar
  params: nnx.State  # the model's parameters, Variables holding arrays (adapters and base alike)
  opt_state: optax.OptState  # of the trained ones: all, or under LoRA the adapters alone
  bad_steps: jax.Array  # int32 scalar: steps not applied because their loss or gradient was not finite


@flax.struct.dataclass
class PreferenceState(TrainState):
  """A DPO run's state where every parameter trains: with `reference`, the parameters it started
  from, which the loss measures the policy against (training/dpo.py: reference_logps); saved with
  the state, so a resumed run compares against the same model. Under LoRA the frozen base stands
  for it and a TrainState is enough."""
  reference: nnx.State


def holds_reference(run: Run) -> bool:
  """Whether a run's state keeps DPO's reference model: preference records on a base that trains."""
  return run.data.preference and not run.model.frozen_base


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a run derives from its settings before touching data or devices' memory."""
  run: Run  # what it was built from
  model_cfg: ModelConfig
  mesh: Mesh
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: TrainState  # ShapeDtypeStructs, no memory: what the devices hold between steps
  state_shardings: TrainState  # NamedShardings, same tree
  # What a checkpoint holds: abstract_state, or where the optimizer state lives off the devices
  # (training/tiers.py) the whole state, whose parameters are the fp32 master weights, while the
  # devices hold no optimizer state and, with the master weights off them too, a copy of the
  # parameters in the compute dtype
  checkpoint_state: TrainState
  # What a start supplies (a meshlm run's checkpoint, a Hugging Face model): checkpoint_state's
  # parameters, or under LoRA and draft heads the base's alone (`base_params`)
  start_params: nnx.State
  opt_compute_shardings: object | None  # where the step computes the optimizer update, when
                                        # the state lives in host memory between steps
  seed: int
  # How a dense model's parameters cross `data` > 1 (sharding/hierarchical.py); with
  # config.partition.hierarchical, state_shardings.params are the master's, split over data too
  hierarchy: hierarchical.Hierarchy | None = None

  def init_state(self, params=None) -> TrainState:
    """Initialise parameters (or start from `params`, already in their shardings: under LoRA the
    base's, the adapters initialised) and the optimizer state, directly into their shardings, at
    step 0. Where the optimizer state lives off the devices, it is left out (None) and the
    parameters are the master weights: training/tiers.py's Engine.load puts them on their tiers,
    so the optimizer state is never whole on the devices."""
    cfg, tx, seed = self.model_cfg, self.tx, self.seed
    off_devices = self.run.optimizer.tiered

    def init(params):
      if params is None or cfg.lora_rank or cfg.draft_heads:
        fresh = nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))
        params = (fresh if params is None else
                  nnx.merge_state(split_adapters(fresh, ADDED)[0], params))
      zero = jnp.zeros((), jnp.int32)
      opt_state = None if off_devices else tx.init(trained(cfg, params)[0])
      state = TrainState(step=zero, params=params, opt_state=opt_state, bad_steps=zero)
      if holds_reference(self.run):  # DPO's reference: the parameters the run starts from
        return PreferenceState(**vars(state), reference=jax.tree.map(jnp.copy, params))
      return state

    with jax.set_mesh(self.mesh):
      return jax.jit(init, out_shardings=self.state_shardings)(params)


def build(run: Run) -> Setup:
  """Check `run` against its target's devices (the mesh: MeshMismatch; kernels and memories they
  lack: ValueError) and derive the mesh, model, optimizer and state shardings (all abstract)."""
  devices = list(run.target.devices)
  model_cfg = run.model
  sizes = sharding.mesh_shape(run.mesh.sizes, len(devices))
  sharding.check_fits_mesh(model_cfg, run.batch_size, run.seq_len, sizes, run.microbatches,
                           length_tile(model_cfg))
  if (model_cfg.experts and model_cfg.expert_matmul == 'pallas' and sizes['stage'] > 1
      and target_lib.compiled_for(devices) is None):
    raise ValueError("config.model.expert_matmul='pallas' runs in interpret mode off GPUs, which "
                     "JAX's Pallas interpreter cannot run inside pipeline stages "
                     f"(config.mesh.stage={sizes['stage']}); use "
                     "--config.model.expert_matmul=ragged_dot here (GPUs compile ours)")
  if model_cfg.attention == 'cudnn' and not attention_runs_on('cudnn', devices[0]):
    raise ValueError(f"config.model.attention='cudnn' needs an NVIDIA GPU, but the devices are "
                     f"{devices[0].platform}; use --config.model.attention=xla")
  if model_cfg.attention == 'hopper' and not attention_runs_on('hopper', devices[0]):
    # On CPUs Mosaic GPU's interpreter runs the kernels (their tests) but not a train step: its
    # callbacks are effects that remat cannot differentiate, and a step without remat hangs.
    raise ValueError(f"config.model.attention='hopper' needs a Hopper GPU (sm_90a: wgmma and "
                     f"the TMA), or a dry run for one (config.plan.target=H100); the devices are "
                     f'{devices[0].device_kind}. Use --config.model.attention=pallas (ours in '
                     'Triton) or auto')
  if model_cfg.matmul_precision == 'fp8' and not has_fp8(devices[0]):
    raise ValueError(f"config.model.matmul_precision='fp8' needs fp8 tensor cores (compute "
                     f"capability 8.9 or newer: Ada, Hopper), which {devices[0].device_kind} "
                     "lacks; use --config.model.matmul_precision=default")
  if (model_cfg.remat_policy.startswith('offload_')
      and not has_host_memory(sharding.local_device(devices))):
    raise ValueError(f'config.model.remat_policy={model_cfg.remat_policy!r} offloads to pinned '
                     f'host memory, {lacking_host_memory(devices[0])}; use a policy without '
                     'offload_, such as full or dots')
  mesh = sharding.make_mesh(sizes, devices)
  if model_cfg.draft_heads and mesh.shape['stage'] > 1:
    raise ValueError('config.model.draft_heads > 0 trains on the last stage\'s hidden states, '
                     'which pipeline stages do not gather yet; set config.mesh.stage=1, or train '
                     'the heads afterwards on one stage (config.model.draft_only=True)')
  if (model_cfg.draft_heads and mesh.shape['sequence'] > 1
      and model_cfg.context_parallel == 'ring'):
    raise ValueError("config.model.draft_heads > 0 reads each token's next ones along the row, "
                     "which ring attention's zigzag order over config.mesh.sequence scatters; set "
                     "config.model.context_parallel='all_gather' for them")

  abstract_model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(run.seed)))
  graphdef, abstract_params = nnx.split(abstract_model)
  param_shardings = sharding.param_shardings(abstract_params, mesh)
  if run.partition.hierarchical and mesh.shape['data'] == 1:  # config.mesh.data=-1 filled in
    raise ValueError('config.partition.hierarchical=True splits the state over config.mesh.data, '
                     'which is 1 here; set config.mesh.data to the number of nodes')
  hierarchy = None
  if mesh.shape['data'] > 1 and hierarchical.replicas_run_apart(
      model_cfg.experts, model_cfg.matmul_precision, model_cfg.frozen_base):
    hierarchy = hierarchical.hierarchy(run.partition, abstract_params, param_shardings, mesh)
    param_shardings = hierarchical.master_shardings(param_shardings, hierarchy.dims)
  schedule = optimizer.make_schedule(run.optimizer, run.train_steps)
  tx = optimizer.make_optimizer(run.optimizer, schedule, model_cfg.draft_heads > 0,
                                trained(model_cfg, param_shardings)[0])
  abstract_opt = jax.eval_shape(tx.init, trained(model_cfg, abstract_params)[0])
  # Adam's moments (and Muon's momentum) mirror the trained parameters and take their shardings;
  # counters are replicated. Where an optimizer updates only some parameters (Muon's matrices,
  # AdamW the rest: optax.partition), each state holds a MaskedNode in the others' place.
  opt_shardings = optax.tree_map_params(
      tx, lambda v, s: v if isinstance(v, optax.MaskedNode) else s, abstract_opt,
      trained(model_cfg, param_shardings)[0],
      transform_non_params=lambda _: sharding.replicated(mesh),
      is_leaf=lambda v: isinstance(v, optax.MaskedNode))
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  opt_compute_shardings = None
  if run.optimizer.offload_state:  # ZeRO-Offload style: moments in pinned host memory
    if not has_host_memory(sharding.local_device(devices)):
      raise ValueError(f'config.optimizer.offload_state=True needs pinned host memory, '
                       f'{lacking_host_memory(devices[0])}; set it to False')
    opt_compute_shardings = opt_shardings
    opt_shardings = jax.tree.map(lambda s: s.with_memory_kind('pinned_host'), opt_shardings)
  state_shardings = TrainState(step=sharding.replicated(mesh), params=param_shardings,
                               opt_state=opt_shardings, bad_steps=sharding.replicated(mesh))
  abstract_state = TrainState(step=scalar, params=abstract_params, opt_state=abstract_opt,
                              bad_steps=scalar)
  if holds_reference(run):  # DPO's reference model, sharded as the parameters
    state_shardings = PreferenceState(**vars(state_shardings), reference=param_shardings)
    abstract_state = PreferenceState(**vars(abstract_state), reference=abstract_params)
  abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                abstract_state, state_shardings)
  checkpoint_state = abstract_state
  if run.optimizer.tiered:  # the devices' share (training/tiers.py)
    if has_host_memory(sharding.local_device(devices)):  # a checkpoint's optimizer state is
      checkpoint_state = checkpoint_state.replace(  # restored to host memory, never whole here
          opt_state=jax.tree.map(lambda a: jax.ShapeDtypeStruct(
              a.shape, a.dtype, sharding=a.sharding.with_memory_kind('pinned_host')),
              checkpoint_state.opt_state))
    copy = (lambda a: a) if run.optimizer.master_on_devices else (
        lambda a: jax.ShapeDtypeStruct(a.shape, model_cfg.dtype, sharding=a.sharding))
    abstract_state = abstract_state.replace(params=jax.tree.map(copy, abstract_state.params),
                                            opt_state=None)
    state_shardings = state_shardings.replace(opt_state=None)
  return Setup(run=run, model_cfg=model_cfg, mesh=mesh, graphdef=graphdef, tx=tx, schedule=schedule,
               abstract_state=abstract_state, state_shardings=state_shardings,
               checkpoint_state=checkpoint_state,
               start_params=base_params(model_cfg, checkpoint_state.params),
               opt_compute_shardings=opt_compute_shardings, seed=run.seed,
               hierarchy=hierarchy)


def check_checkpoints(checkpointer, setup, read: dict | None) -> None:
  """Before data or memory are touched: the workdir's checkpoints (else those the run starts
  from, a meshlm run or a Hugging Face checkpoint) hold the run's model, and a resumed run keeps
  what it must (its settings of the kinds configs/effects.py: KEPT_ON_RESUME, and what it reads:
  `read`, trained_on's); another vocabulary is named as a tokenizer mistake."""
  run = setup.run
  try:
    steps = checkpointer.steps() if checkpointer else []
    if checkpointer:
      checkpointer.check_fresh_start()
    settings_now = {**run.as_dict(), 'mesh_shape': dict(setup.mesh.shape)} if steps else None
    for step in steps:  # the newest that reads; older ones are fallbacks
      if saved := checkpointer.saved_config(step):  # the settings first: they name the change
        checkpoint_lib.check_resume(saved, settings_now, checkpointer.directory / str(step), read)
      if checkpointer.reads_as(setup.checkpoint_state, step, setting='config.workdir',
                               model_config=run.model):
        return
    if run.start.kind == HF and not steps:
      huggingface.check_tensors(run.start.path, setup.start_params, setup.model_cfg)
    elif run.start.kind == RUN and not steps:
      checkpoint_lib.check_init_from(run.init_from, setup.start_params, run.model,
                                     unwanted=is_added)
  except checkpoint_lib.CheckpointMismatch as e:
    if 'vocab_size' in e.saved_model:
      tokenizers.check_checkpoint_vocab(e.saved_model['vocab_size'], run.tokenizer,
                                        run.model.vocab_size)
    raise


def initial_state(setup, checkpointer, log, pieces=None):
  """(step, state, data state): resumed from the workdir's newest checkpoint that restores, else
  a new run from the parameters it starts from (run.start), or from scratch. `pieces`: what a
  resumed run reads into its tiers a piece at a time (training/tiers.py: Engine.restoring)."""
  run = setup.run
  restored = (checkpointer.restore_latest(setup.checkpoint_state, run.model, pieces)
              if checkpointer else None)
  if restored:
    log(f'resuming from step {restored[0]} ({checkpointer.directory / str(restored[0])})')
    saved = checkpointer.saved_config(restored[0])
    if changes := effects.changed(saved, run.as_dict(), ('schedule',)):  # may change: named
      log(f'from step {restored[0]} on, the schedule differs from its checkpoint\'s: ' + ', '.join(
          f'config.{field} {before!r} → {now!r}' for field, before, now in changes))
    return restored
  params = None  # from scratch, unless the run names a start
  if run.start.kind == HF:
    params = huggingface.load_params(run.start.path, setup.start_params, setup.model_cfg)
    log(f'starting from the Hugging Face checkpoint {run.start.path} (fresh optimizer, step 0)')
    if dropped := huggingface.left_out(run.start.path):
      log(f'left out of {run.start.path}: {dropped}')
  elif run.start.kind == RUN:
    params, path, notes = params_of_run(setup)
    log(f'starting from the parameters of {path} (fresh optimizer, step 0): ' + '; '.join(notes))
  return 0, setup.init_state(params), None


def params_of_run(setup):
  """(the parameters a run starts from where config.init_from names a meshlm run, in
  start_params' shardings, with the draft heads it takes; the step directory; what the start
  takes and leaves, for its line). It takes the model that run trained: its LoRA adapters merged
  into the base (config.init_adapters='merge', else left), its draft heads where this run
  trains the same ones (else left, which the line says, with how to keep them)."""
  run, cfg = setup.run, setup.model_cfg
  saved = (run.start.saved or {}).get('model', {})
  rank, heads = saved.get('lora_rank', 0), saved.get('draft_heads', 0)
  merge = bool(rank) and run.init_adapters == 'merge'
  take_heads = bool(heads) and (cfg.draft_heads, cfg.draft_kind) == (
      heads, saved.get('draft_kind', cfg.draft_kind))
  notes = [f'its base model, the {run.tokenizer.name} tokenizer {run.tokenizer.fingerprint}'
           + (f', the chat template {run.template.digest}' if run.template else '')]
  if rank:
    notes.append(f"its LoRA adapters (rank {rank}) merged into the base (config.init_adapters="
                 f"'merge'; 'leave' starts from the base they adapted)" if merge else
                 f"its LoRA adapters (rank {rank}) left out (config.init_adapters='leave'): the "
                 "base they adapted; 'merge' starts from the model they make")
  if heads:
    kind = saved.get('draft_kind', cfg.draft_kind)
    notes.append(f'its {heads} draft heads' if take_heads else
                 f'its {heads} draft heads left out, this run training '
                 f'{cfg.draft_heads or "none"}{f" ({cfg.draft_kind})" if cfg.draft_heads else ""}'
                 f'; to keep them: --config.model.draft_heads={heads} '
                 f'--config.model.draft_kind={kind}')
  if not (merge or take_heads):
    params, path = checkpoint_lib.restore_params(run.init_from, setup.start_params, run.model,
                                                 unwanted=is_added)
    return params, path, notes
  # The model that run trained, as it saved it (its adapters, its heads), on this run's mesh.
  theirs = dataclasses.replace(
      cfg, lora_rank=rank if merge else 0, lora_alpha=saved.get('lora_alpha', cfg.lora_alpha),
      lora_targets=saved.get('lora_targets', cfg.lora_targets),
      draft_heads=heads if take_heads else 0, draft_only=False)
  abstract = nnx.split(nnx.eval_shape(lambda: Transformer(theirs, rngs=nnx.Rngs(0))))[1]
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, sharding.param_shardings(abstract, setup.mesh))

  taken = {LoRA} if merge else set()
  taken |= {Draft} if take_heads else set()

  def unwanted(name):
    return is_added(name) and added_kind(name) not in taken

  params, path = checkpoint_lib.restore_params(run.init_from, abstract, theirs,
                                               unwanted=unwanted)
  wanted = setup.start_params
  if take_heads:
    wanted = nnx.merge_state(split_adapters(setup.checkpoint_state.params, Draft)[0], wanted)

  def start(params):
    pure = nnx.to_pure_dict(params)
    if merge:
      pure = adapters_merged(pure, theirs.lora_scale)
    out = jax.tree.map(lambda a: a, wanted)  # a copy of the structure, filled in place
    nnx.replace_by_pure_dict(out, pure)
    return jax.tree.map(lambda a, x: x.astype(a.dtype), wanted, out)

  # The arrays read are given up to the base they become (not twice the parameters at once);
  # the adapters', merged, are of no output's shape, which JAX would warn of.
  with jax.set_mesh(setup.mesh), warnings.catch_warnings():
    warnings.filterwarnings('ignore', 'Some donated buffers were not usable')
    params = jax.jit(start, out_shardings=jax.tree.map(lambda a: a.sharding, wanted),
                     donate_argnums=0)(params)
  return params, path, notes


def capability(device) -> tuple[int, int]:
  """A GPU's compute capability: planning/gpus.py's, else as the device reports it."""
  known = gpus.find(device.device_kind)
  return (known.compute_capability if known else
          tuple(int(n) for n in str(device.compute_capability).split('.')))


def attention_runs_on(kernel: str, device) -> bool:
  """Whether attention `kernel` (config.model.attention, made concrete) runs on `device`:
  cuDNN's on an NVIDIA GPU, our Hopper kernel on sm_90a, ours in Triton on any NVIDIA GPU (it
  interprets elsewhere: a test's speed, not a forward's)."""
  if kernel in ('cudnn', 'pallas'):
    return device.platform == 'gpu'
  if kernel == 'hopper':
    return device.platform == 'gpu' and capability(device) == (9, 0)
  return True


def has_fp8(device) -> bool:
  """Whether `device` multiplies fp8 natively: a GPU of compute capability 8.9 or newer; on CPU
  fp8 is emulated, for tests."""
  return device.platform != 'gpu' or capability(device) >= (8, 9)


def has_host_memory(device) -> bool:
  return 'pinned_host' in {m.kind for m in device.addressable_memories()}


def lacking_host_memory(device) -> str:
  """Why `device` has no pinned host memory: a GPU compiled for without one (a plan's deviceless
  compile: its devices have no memories at all) or a backend without it."""
  if gpus.find(device.device_kind) and not device.addressable_memories():
    return (f'which a plan compiled here for {device.device_kind} cannot place arrays in (the '
            'deviceless compiler has no host memory; a dry run on the GPUs plans it)')
  return f'which this {device.platform} backend does not offer'


def param_count(abstract_params) -> int:
  return sum(x.size for x in jax.tree.leaves(abstract_params))
