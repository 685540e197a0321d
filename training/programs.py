"""The train and eval steps compiled ahead of time (one jit each, explicit shardings, the train
state donated), and the compiled step's plan: what the loop, the layout search and the dry run
run and read. What a step computes is training/step.py's."""

import jax
import numpy as np
import optax

from planning import gpus
from planning import plan as plan_lib
import sharding
from training.optimizer import trained
from training.state import Setup
from training.step import make_eval_step, make_gradient_step, make_train_step

BATCH_KEYS = {'inputs': np.int32, 'targets': np.int32, 'positions': np.int32,
              'segment_ids': np.int32, 'weights': np.float32}
UNPACKED_KEYS = {k: v for k, v in BATCH_KEYS.items() if k != 'segment_ids'}  # one document a row


def abstract_batch(mesh, batch_size: int, seq_len: int, packed: bool = True,
                   extra: dict | None = None) -> dict:
  """The step's batch: BATCH_KEYS (without segment ids unless `packed`), and a loss's `extra`
  {key: dtype} of the same [B, L] shape (training/grpo.py: GRPO.batch_keys)."""
  s = sharding.batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct((batch_size, seq_len), dt, sharding=s)
          for k, dt in {**(BATCH_KEYS if packed else UNPACKED_KEYS), **(extra or {})}.items()}


# fp8 projections become cuBLASLt fp8 GEMMs only where XLA neither hands their dots to Triton nor
# merges dots sharing an operand (q, k, v; gate, up): a merged dot's concatenated operand holds
# tensors of different scales. Both options are XLA's GPU compiler's; the found rule is checked
# on the compiled HLO (tests/test_gpu_compile.py).
FP8_COMPILER_OPTIONS = {'xla_gpu_enable_triton_gemm': False, 'xla_gpu_dot_merger_threshold_mb': 0}
# For GPUs that are not there, XLA's autotuner still compiles candidate kernels it cannot time,
# then takes the defaults it would take without it: the same program (HLO, tilings, memory and
# predicted time checked equal for the 125m, 1b and 8b presets) in about half the compile time.
DEVICELESS_COMPILER_OPTIONS = {'xla_gpu_autotune_level': 0}
# config.model.prefetch_weights: a scanned layer gathers its FSDP-sharded weights at its start,
# and its compute waits for them, hidden only behind what XLA schedules between, inside the
# layer. XLA's collective pipeliner moves each layer's gathers into the iteration before, under
# the previous layer's compute, for one more layer's gathered weights. Where the gathers cross
# nodes, waiting on them is the step's largest cost, and the 70b on 32 H100s plans faster for a
# little memory. It does not always pay: with microbatches XLA pipelines their loop too, and the
# 8b preset's unrolled layers plan slower and far larger with it (docs/parallelism.md has the
# plans). So it is a preset's choice (configs/llama.py: 70b), made from the plans.
PREFETCH_COMPILER_OPTIONS = {'xla_gpu_pipeline_all_gather': 'COLLECTIVE_PIPELINING_MODE_ON'}
# config.model.scheduler_memory: XLA's scheduler (and its rematerialization) plans a step within
# (the memory JAX's allocator holds − the step's inputs and outputs) × this share, 0.95 by default
# (xla_gpu_memory_limit_slop_factor; docs/gpus-without-a-gpu.md says why a compile for GPUs that
# are not there plans within the same bytes). Within less, it starts fewer collectives early and
# holds fewer buffers at once: memory for a little time (docs/memory.md has the 8b's plans). Above
# 1 is no mistake where the state is most of the memory: inside the microbatch loop XLA's
# scheduler counts the loop's carry, the gradient sums it has already taken out as the step's
# outputs, against the share again, finds no room, and starts no collective early (the 70b-1node
# preset overlaps its gathers only from a share of 4 on: docs/memory.md).


def scheduler_options(share: float) -> dict:
  return ({} if share == gpus.XLA_SCHEDULER_MEMORY
          else {'xla_gpu_memory_limit_slop_factor': round(100 * share)})


def compiler_options(setup: Setup) -> dict:
  """XLA options for this setup's programs: FP8_COMPILER_OPTIONS for fp8 projections on GPUs,
  DEVICELESS_COMPILER_OPTIONS for GPUs that are not there (the run's target says which),
  PREFETCH_COMPILER_OPTIONS where config.model.prefetch_weights says so, and the scheduler's share
  of the memory (config.model.scheduler_memory)."""
  if setup.mesh.devices.flat[0].platform != 'gpu':
    return {}
  fp8 = setup.model_cfg.matmul_precision == 'fp8'
  return {**(FP8_COMPILER_OPTIONS if fp8 else {}),
          **(DEVICELESS_COMPILER_OPTIONS if setup.run.target.deviceless else {}),
          **(PREFETCH_COMPILER_OPTIONS if setup.model_cfg.prefetch_weights else {}),
          **scheduler_options(setup.model_cfg.scheduler_memory)}


def compile_train_step(setup: Setup, batch_size: int, seq_len: int, z_loss: float,
                       packed: bool = True, microbatches: int = 1, loss=None):
  """Ahead-of-time compiled train step: (state, batch) → (state, metrics); state is donated.
  `packed=False` compiles for batches without segment ids (one document a row); `loss`:
  make_train_step's, its rows with its own `batch_keys` besides."""
  options = compiler_options(setup)
  batch = abstract_batch(setup.mesh, batch_size, seq_len, packed,
                         getattr(loss, 'batch_keys', None))
  jitted = jax.jit(make_train_step(setup, z_loss, microbatches, loss),
                   in_shardings=(setup.state_shardings, jax.tree.map(lambda x: x.sharding, batch)),
                   out_shardings=(setup.state_shardings, sharding.replicated(setup.mesh)),
                   donate_argnums=0)
  with jax.set_mesh(setup.mesh):
    return jitted.lower(setup.abstract_state, batch).compile(options)


def compile_gradient_step(setup: Setup, batch_size: int, seq_len: int, z_loss: float,
                          microbatches: int = 1):
  """Ahead-of-time compiled step without its update, for a run whose optimizer state lives off
  the devices (training/tiers.py): (the devices' state: no optimizer state, batch) → (gradients
  in the parameters' shardings, their global norm (what clipping divides them by, a group at a
  time in the update: clipped here they would be a second copy), whether the step is finite, the
  next step count, the bad steps, metrics). With the master weights off the devices, the
  parameters here are a compute-dtype copy and so are their gradients (summed over microbatches
  in fp32)."""
  options = compiler_options(setup)
  batch = abstract_batch(setup.mesh, batch_size, seq_len)
  gradient_step = make_gradient_step(setup, z_loss, microbatches)

  def step(state, batch):
    grads, _, finite, metrics = gradient_step(state, batch)
    return (grads, optax.tree.norm(grads), finite, state.step + 1, metrics['bad_steps'],
            metrics)
  replicated = sharding.replicated(setup.mesh)
  jitted = jax.jit(step, in_shardings=(setup.state_shardings,
                                       jax.tree.map(lambda x: x.sharding, batch)),
                   out_shardings=(trained(setup.model_cfg, setup.state_shardings.params)[0],
                                  *[replicated] * 5))
  with jax.set_mesh(setup.mesh):
    return jitted.lower(setup.abstract_state, batch).compile(options)


def compile_eval_step(setup: Setup, batch_size: int, seq_len: int, token_bytes_V,
                      microbatches: int = 1):
  options = compiler_options(setup)
  batch = abstract_batch(setup.mesh, batch_size, seq_len)
  reference = getattr(setup.state_shardings, 'reference', None)  # DPO's, where the state has one
  jitted = jax.jit(make_eval_step(setup, token_bytes_V, microbatches),
                   in_shardings=(setup.state_shardings.params, reference,
                                 jax.tree.map(lambda x: x.sharding, batch)),
                   out_shardings=sharding.replicated(setup.mesh))
  with jax.set_mesh(setup.mesh):
    return jitted.lower(setup.abstract_state.params,
                        getattr(setup.abstract_state, 'reference', None),
                        batch).compile(options)


def compile_and_plan(setup: Setup):
  """(compiled train step, its planning.plan.Plan for the run's target) for the devices of
  setup's mesh: compiling needs only the abstract state. Where the optimizer state lives off the
  devices, the step is compile_gradient_step's, which training/tiers.py completes."""
  run = setup.run
  compile_step = compile_gradient_step if run.optimizer.tiered else compile_train_step
  compiled = compile_step(setup, run.batch_size, run.seq_len, run.loss.z_loss,
                          microbatches=run.microbatches)
  return compiled, plan_lib.make_plan(compiled, plan_lib.Step(
      model=setup.model_cfg, optimizer=run.optimizer, partition=run.partition, target=run.target,
      mesh=setup.mesh, batch_size=run.batch_size, seq_len=run.seq_len,
      microbatches=run.microbatches, preference=run.data.preference,
      abstract_state=setup.abstract_state, checkpoint_params=setup.checkpoint_state.params))
