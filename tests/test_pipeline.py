"""Pipeline parallelism (model/pipeline.py) on 8 CPU devices: stage meshes train as one device
does, only activations cross stages, the compiled schedule has its ticks, and checkpoints move
between stage counts."""

import functools

import jax
import numpy as np
import pytest

import sharding
from model import pipeline
from runtime.checkpoint import Checkpointer
from sharding import collectives
from tests.conftest import tiny_config
from training import step as step_lib
from training.state import build

STEPS, M = 20, 4


def pipeline_config(microbatches=M, dtype='float32', **mesh):
  config = tiny_config(**mesh)
  config.model.n_layers, config.batch_size, config.microbatches = 4, 16, microbatches
  config.model.compute_dtype = dtype
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
    yield {k: jax.device_put(np.asarray(v, step_lib.BATCH_KEYS[k]), s) for k, v in host.items()}


@functools.cache
def compiled(remat='none', microbatches=M, dtype='float32', **mesh):
  config = pipeline_config(microbatches, dtype, **mesh)
  config.model.remat_policy = remat
  setup = build(config, jax.devices() if mesh else jax.devices()[:1])
  return setup, config, step_lib.compile_train_step(setup, config.batch_size, config.seq_len,
                                                    1e-4, microbatches=microbatches)


def train(remat='none', steps=STEPS, dtype='float32', **mesh):
  setup, config, step = compiled(remat, M if mesh else 1, dtype, **mesh)
  state, losses = setup.init_state(), []
  for batch in batches(setup, config, steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  return np.array(losses), state


@functools.cache
def reference(dtype='float32'):
  losses, state = train(dtype=dtype)
  return losses, jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize('remat,dtype,mesh', [
    ('none', 'float32', dict(stage=2, fsdp=4)),
    ('full', 'bfloat16', dict(stage=4, fsdp=2)),
    ('dots', 'float32', dict(stage=2, fsdp=2, tensor=2))],
    ids=['stage=2', 'stage=4,remat=full,bf16', 'stage=2×fsdp=2×tensor=2,remat=dots'])
def test_stages_train_as_one_device(remat, dtype, mesh):
  """20 steps: the same losses as one device running the whole batch in the same compute dtype
  (no remat), each stage holding only its layers; in fp32 the same parameters too (in bf16,
  Adam's first steps turn rounding differences into visible ones)."""
  want_losses, want_params = reference(dtype)
  losses, state = train(remat, dtype=dtype, **mesh)
  assert want_losses[-1] < want_losses[0] / 2  # it learns
  tight = dtype == 'float32'  # bf16: the order of the sums over devices differs
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5 if tight else 2e-3)
  compared = jax.tree.leaves(want_params) if tight else ()
  for got, want in zip(jax.tree.leaves(state.params), compared):
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-6)
  wq = state.params['blocks']['attn']['wq'][...]
  layers = wq.shape[0] // mesh['stage']
  assert {s.data.shape[0] for s in wq.addressable_shards} == {layers}
  assert {s.index[0].start for s in wq.addressable_shards} == set(range(0, wq.shape[0], layers))


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


def test_only_activations_cross_stages_in_the_compiled_step():
  """Along `stage` the program moves a microbatch's activations by collective-permute, once a
  tick each way, plus the sums that hand the last stage's outputs (and the input's gradient) to
  every stage; no parameter or gradient of one crosses. The schedule runs M + P − 1 ticks."""
  setup, config, step = compiled('dots', M, 'float32', stage=2, fsdp=2, tensor=2)
  stages, b = 2, config.batch_size // M // 2  # rows of a microbatch per device (fsdp=2)
  activation = (b, config.seq_len, config.model.d_model)
  stage_of = lambda device: device // (8 // stages)  # stage is the mesh's outer axis here
  crossing = [c for c in collectives.executed(step.as_text()) if c.crosses(stage_of)]
  permutes = [c for c in crossing if c.op == 'collective-permute']
  assert len(permutes) == 2  # forward, and its transpose in the backward
  for c in permutes:
    assert c.arrays == (('f32', activation),)
    assert c.executions == pipeline.ticks(M, stages) == M + stages - 1
  for c in crossing:
    assert c.op in ('collective-permute', 'all-reduce'), c
    assert {shape for _, shape in c.arrays} <= {activation, (M, *activation), ()}, c


def test_a_checkpoint_moves_between_stage_counts(tmp_path):
  """Saved with stage=4 (each stage holding a quarter of the layers), restored whole under
  stage=2 and on one device: the stacked layers keep one array layout whatever the stages."""
  saved = build(pipeline_config(stage=4, fsdp=2))
  state = saved.init_state()
  checkpointer = Checkpointer(tmp_path, keep=1)
  checkpointer.save(1, state, {}, {})
  checkpointer.close()
  for mesh, devices in ((dict(stage=2, fsdp=4), jax.devices()), ({}, jax.devices()[:1])):
    target = build(pipeline_config(**mesh), devices)
    _, restored, _ = Checkpointer(tmp_path).restore_latest(target.abstract_state,
                                                           target.model_cfg)
    for got, want, where in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params),
                                jax.tree.leaves(target.state_shardings.params)):
      assert got.sharding == where
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize('change, message', [
    (dict(n_layers=3), r'config.model.n_layers=3 is not divisible by config.mesh.stage=2'),
    (dict(microbatches=1), r'config.microbatches=1 is fewer than config.mesh.stage=2'),
    (dict(batch_size=12), r'config.batch_size=12 is not divisible by config.microbatches=4'),
])
def test_pipeline_settings_that_cannot_work_are_named(change, message):
  config = pipeline_config(stage=2, fsdp=4)
  if 'n_layers' in change:
    config.model.n_layers = change['n_layers']
  else:
    config.update(change)
  with pytest.raises(sharding.MeshMismatch, match=message):
    build(config)

