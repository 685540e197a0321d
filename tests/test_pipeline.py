"""Pipeline parallelism (model/pipeline.py) on 8 CPU devices: stage meshes train as one device
does, only activations cross stages, the compiled schedule has its ticks, and checkpoints move
between stage counts."""

import functools
import math

import jax
import numpy as np
import pytest

from model import pipeline
from runtime.checkpoint import Checkpointer, CheckpointMismatch
from sharding import collectives
import sharding
from tests.conftest import tiny_config
from training import programs
from training import settings
from training.state import build

STEPS, M = 20, 4


def pipeline_config(microbatches=M, dtype='float32', virtual=1, n_layers=4, **mesh):
  config = tiny_config(**mesh)
  config.model.n_layers, config.batch_size, config.microbatches = n_layers, 16, microbatches
  config.model.compute_dtype, config.model.virtual_stages = dtype, virtual
  return config


def batches(setup, config, steps=STEPS):
  """A learnable task (each target is its input token) in packed rows of four documents."""
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  quarter = config.seq_len // 4
  s = sharding.batch_sharding(setup.mesh)
  for _ in range(steps):
    tokens = rng.integers(0, 64, shape)
    host = {'inputs': tokens, 'targets': tokens, 'weights': np.ones(shape),
            'positions': np.tile(np.arange(quarter), 4)[None].repeat(shape[0], 0),
            'segment_ids': np.repeat(np.arange(1, 5), quarter)[None].repeat(shape[0], 0)}
    yield {k: jax.device_put(np.asarray(v, programs.BATCH_KEYS[k]), s) for k, v in host.items()}


@functools.cache
def compiled(remat='none', microbatches=M, dtype='float32', virtual=1, **mesh):
  config = pipeline_config(microbatches, dtype, virtual, **mesh)
  config.model.remat_policy = remat
  setup = build(settings.resolve(config, jax.devices() if mesh else jax.devices()[:1]))
  return setup, config, programs.compile_train_step(setup, config.batch_size, config.seq_len,
                                                    1e-4, microbatches=microbatches)


def train(remat='none', steps=STEPS, dtype='float32', virtual=1, **mesh):
  setup, config, step = compiled(remat, M if mesh else 1, dtype, virtual, **mesh)
  state, losses = setup.init_state(), []
  for batch in batches(setup, config, steps):
    state, metrics = step(state, batch)
    losses.append([float(metrics['loss']), float(metrics['grad_norm'])])
  return np.array(losses), state


@functools.cache
def reference(dtype='float32'):
  losses, state = train(dtype=dtype)
  return losses, jax.tree.map(np.asarray, state.params)


@pytest.mark.integration
@pytest.mark.parametrize('remat,dtype,virtual,mesh', [
    ('save_attention', 'float32', 1, dict(stage=2, fsdp=4)),
    ('full', 'bfloat16', 1, dict(stage=4, fsdp=2)),
    ('dots', 'float32', 1, dict(stage=2, fsdp=2, tensor=2)),
    ('none', 'float32', 2, dict(stage=2, fsdp=4))],
    ids=['stage=2,remat=save_attention', 'stage=4,remat=full,bf16',
         'stage=2×fsdp=2×tensor=2,remat=dots',
         'stage=2,virtual=2'])
def test_stages_train_as_one_device(remat, dtype, virtual, mesh):
  """20 steps, under four remat policies: the same losses as one device running the whole batch
  in the same compute dtype (no remat, one chunk), each stage holding only its layers; in fp32
  the same parameters too (in bf16, Adam's first steps turn rounding differences into visible
  ones). The gradient norms too, which Adam's update and clipping above the norm cannot see: with
  per-shard results in a stage typed invariant, every stage's gradient was once the sum over stages
  of theirs (sharding/per_shard.py)."""
  want_losses, want_params = reference(dtype)
  losses, state = train(remat, dtype=dtype, virtual=virtual, **mesh)
  assert want_losses[-1, 0] < want_losses[0, 0] / 2  # it learns
  tight = dtype == 'float32'  # bf16: the order of the sums over devices differs
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5 if tight else 2e-3)
  compared = jax.tree.leaves(want_params) if tight else ()
  for got, want in zip(jax.tree.leaves(state.params), compared):  # [V, n/V, ...] is [n, ...]
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=2e-4, atol=2e-6)
  wq = state.params['blocks']['attn']['wq'][...]
  dim = int(virtual > 1)  # 'layers'
  layers = wq.shape[dim] // mesh['stage']
  assert {s.data.shape[dim] for s in wq.addressable_shards} == {layers}
  assert {s.index[dim].start for s in wq.addressable_shards} == set(range(0, wq.shape[dim], layers))
  assert {s.data.shape[0] for s in wq.addressable_shards} == {virtual} or virtual == 1


@pytest.mark.integration
def test_a_non_finite_step_is_skipped_by_every_stage():
  setup, config, step = compiled('dots', M, 'float32', stage=2, fsdp=2, tensor=2)
  state = setup.init_state()
  before = jax.tree.map(np.asarray, state.params)
  batch = next(batches(setup, config))
  batch['weights'] = batch['weights'].at[0, 0].set(np.nan)
  state, metrics = step(state, batch)
  assert bool(metrics['skipped']) and int(state.bad_steps) == 1
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize('remat,virtual,mesh', [
    ('dots', 1, dict(stage=2, fsdp=2, tensor=2)), ('none', 2, dict(stage=2, fsdp=4))],
    ids=['gpipe', 'virtual=2'])
@pytest.mark.integration
def test_only_activations_cross_stages_in_the_compiled_step(remat, virtual, mesh):
  """Along `stage` the program moves a microbatch's activations by collective-permute, once a
  tick each way, plus the sums that hand the last stage's outputs (and the input's gradient) to
  every stage and gather the per-token losses of the head, which each stage runs on its share of
  the microbatches; no parameter crosses, and of the gradients only the head's (its weight's and
  the final norm's), summed over the stages. The schedule runs V·M + P − 1 ticks; with V chunks the last stage passes
  back to the first (a ring), without them it does not."""
  setup, config, step = compiled(remat, M, 'float32', virtual, **mesh)
  stages = mesh['stage']
  b = config.batch_size // M // mesh['fsdp']  # rows of a microbatch per device
  activation = (b, config.seq_len, config.model.d_model)
  stage_of = lambda device: device // (8 // stages)  # stage is the mesh's outer axis here
  crossing = [c for c in collectives.executed(step.as_text()) if c.crosses(stage_of)]
  permutes = [c for c in crossing if c.op == 'collective-permute']
  assert len(permutes) == 2  # forward, and its transpose in the backward
  forward = {(s, (s + 1) % stages) for s in range(stages if virtual > 1 else stages - 1)}
  assert [{(stage_of(a), stage_of(b)) for a, b in c.devices} for c in permutes] in (
      [forward, {(b, a) for a, b in forward}], [{(b, a) for a, b in forward}, forward])
  for c in permutes:
    assert c.arrays == (('f32', activation),)
    assert c.executions == pipeline.ticks(M, stages, virtual) == virtual * M + stages - 1
  D, V, t = config.model.d_model, config.model.vocab_size, mesh.get('tensor', 1)
  losses = {(M, b, config.seq_len), (M // stages, b, config.seq_len)}  # all, and a stage's share
  head = {(D // mesh['fsdp'], V // t), (V // t, D // mesh['fsdp'])}  # the head weight's gradient
  for c in crossing:
    assert c.op in ('collective-permute', 'all-reduce'), c
    for _, shape in c.arrays:
      assert (shape in {activation, (M, *activation), (), *losses, *head}
              or math.prod(shape) == D), c  # the last, the final norm's gradient


@pytest.mark.integration
@pytest.mark.parametrize('virtual', [1, 2])
def test_a_checkpoint_moves_between_stage_counts(tmp_path, virtual):
  """Saved with stage=4 (each stage holding a quarter of the layers, or of each chunk), restored
  whole under stage=2 and on one device: the stacked layers keep one array layout whatever the
  stages."""
  layout = dict(virtual=virtual, n_layers=4 * virtual)
  config = pipeline_config(stage=4, fsdp=2, **layout)
  state = build(settings.resolve(config)).init_state()
  checkpointer = Checkpointer(tmp_path, keep=1)
  checkpointer.save(1, state, {}, {'model': config.model.to_dict()})
  checkpointer.close()
  for mesh, devices in ((dict(stage=2, fsdp=4), jax.devices()), ({}, jax.devices()[:1])):
    config = pipeline_config(**layout, **mesh)
    target = build(settings.resolve(config, devices))
    _, restored, _ = Checkpointer(tmp_path).restore_latest(target.abstract_state, config.model)
    for got, want, where in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params),
                                jax.tree.leaves(target.state_shardings.params)):
      assert got.sharding == where
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # The chunks are a dimension of the stacked parameters: another count is another model.
  config = pipeline_config(virtual=3 - virtual, n_layers=4 * virtual, stage=2, fsdp=4)
  with pytest.raises(CheckpointMismatch, match=f'virtual_stages {virtual} → {3 - virtual}'):
    Checkpointer(tmp_path).restore_latest(build(settings.resolve(config)).abstract_state, config.model)


@pytest.mark.parametrize('change, message', [
    (dict(n_layers=3), r'config.model.n_layers=3 is not divisible by config.mesh.stage=2'),
    (dict(virtual_stages=4), r'config.model.n_layers=4 is not divisible by config.mesh.stage=2 '
                             r'× config.model.virtual_stages=4'),
    (dict(virtual_stages=3), r'config.model.n_layers=4 is not divisible by '
                             r'config.model.virtual_stages=3'),
    (dict(microbatches=1), r'config.microbatches=1 is fewer than config.mesh.stage=2'),
    (dict(batch_size=12), r'config.batch_size=12 is not divisible by config.microbatches=4'),
])
def test_pipeline_settings_that_cannot_work_are_named(change, message):
  config = pipeline_config(stage=2, fsdp=4)
  model_fields = {'n_layers', 'virtual_stages'} & set(change)
  config.model.update({k: change.pop(k) for k in model_fields})
  config.update(change)
  with pytest.raises(ValueError, match=message):
    build(settings.resolve(config))



def test_our_kernel_under_stages_and_a_split_sequence_is_refused_naming_both():
  """Inside a stage's manual region our kernel's gradients lose the stage's type (JAX refuses
  the custom VJP); `xla` attention runs there."""
  config = pipeline_config(stage=2, sequence=4)
  config.model.attention = 'pallas'
  with pytest.raises(ValueError, match=r"attention='pallas' cannot yet run with both "
                                       r'config.mesh.stage=2 and config.mesh.sequence=4'):
    build(settings.resolve(config))

