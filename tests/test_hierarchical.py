"""Hierarchical, quantized partitioning (sharding/hierarchical.py, config.partition): int8 blocks
against NumPy, training equal to plain FSDP, the master's actual shards, and the refusals. The
bytes a compiled H100 step sends across nodes are tests/test_gpu_compile.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding import hierarchical
from sharding.hierarchical import PartitionConfig
from tests.conftest import tiny_config
from tests.test_moe import train
from training import settings
from training.state import build


def numpy_int8(x, block):
  """The reference: per block of the last dimension, scale = amax/127, q = round(x/scale)."""
  x_nb = x.reshape(*x.shape[:-1], -1, block).astype(np.float32)
  amax = np.abs(x_nb).max(axis=-1, keepdims=True)
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1))
  return np.clip(np.round(x_nb / scale), -127, 127).astype(np.int8).reshape(x.shape), scale[..., 0]


@pytest.mark.parametrize('block', [256, 64])
def test_int8_blocks_match_numpy_and_stay_within_half_a_step(block):
  rng = np.random.default_rng(0)
  # Blocks of very different magnitudes, one of zeros, one whose largest value is negative.
  x = rng.standard_normal((6, 512)).astype(np.float32) * np.logspace(-6, 3, 6)[:, None]
  x[2] = 0.0
  x[3, 5] = -1e4
  q, scale = jax.jit(hierarchical.quantize, static_argnums=1)(jnp.asarray(x), block)
  q_ref, scale_ref = numpy_int8(x, block)
  # XLA may divide by 127 as a multiply by its reciprocal: scales within an ulp, and a value
  # on a rounding boundary a step away.
  np.testing.assert_allclose(np.asarray(scale), scale_ref, rtol=2e-7)
  steps = np.abs(np.asarray(q).astype(int) - q_ref)
  assert steps.max() <= 1 and steps.mean() < 1e-3
  y = np.asarray(hierarchical.dequantize(q, scale))
  amax = np.repeat(np.abs(x.reshape(6, -1, block)).max(-1), block, axis=-1)
  assert np.all(np.abs(y - x) <= amax / 254 * (1 + 1e-6))
  np.testing.assert_array_equal(y[2], 0.0)  # zeros stay exactly zero
  largest = (np.abs(x) == amax) & (amax > 0)  # each block's largest magnitude is ±127 steps, back within an ulp
  assert np.all(np.abs(np.asarray(q))[largest] == 127)
  np.testing.assert_allclose(y[largest], x[largest], rtol=1e-6)
  assert y[3, 5] == pytest.approx(-1e4, rel=1e-6)


def test_a_non_finite_block_dequantizes_to_nan_never_inf():
  x = np.ones((2, 512), np.float32)
  x[0, 3], x[1, 300] = np.inf, np.nan
  q, scale = hierarchical.quantize(jnp.asarray(x), 256)
  y = np.asarray(hierarchical.dequantize(q, scale, jnp.bfloat16).astype(jnp.float32))
  assert not np.isinf(y).any()
  assert np.isnan(y[0, :256]).all() and np.isnan(y[1, 256:]).all()  # the blocks holding them
  np.testing.assert_array_equal(y[0, 256:], 1.0)  # the others untouched
  np.testing.assert_array_equal(y[1, :256], 1.0)


STEPS = 6


def partitioned(partition=None, **mesh):
  config = tiny_config(**mesh)
  config.microbatches, config.batch_size = 2, 16
  config.partition.update(partition or {})
  return config


@pytest.fixture(scope='module')
def plain_fsdp(small_corpus):
  return train(partitioned(fsdp=8), jax.devices(), small_corpus, STEPS, keep={STEPS})


@pytest.mark.integration
def test_hierarchical_partitioning_trains_as_plain_fsdp(plain_fsdp, small_corpus):
  """data=2 × fsdp=4 with the state split over all 8 devices, two microbatches: losses,
  gradient norms and parameters as fsdp=8's (fp32 here; only the order of sums differs); and
  the parameters and Adam's moments really are split over data, along the chosen dimension."""
  config = partitioned(dict(hierarchical=True), data=2, fsdp=4)
  ref_curve, ref_params = plain_fsdp
  curve, params = train(config, jax.devices(), small_corpus, STEPS, keep={STEPS})
  assert ref_curve[-1, 0] < ref_curve[0, 0]
  np.testing.assert_allclose(curve, ref_curve, rtol=2e-6, atol=1e-6)
  for a, b in zip(params[STEPS], ref_params[STEPS]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  setup = build(settings.resolve(config))
  state = setup.init_state()
  L, D, F = state.params['blocks']['mlp']['w_gate'].shape
  mu = state.opt_state[1][0].mu['blocks']['mlp']['w_gate']  # after clipping: adamw's moments
  for array in (state.params['blocks']['mlp']['w_gate'], mu):
    shards = array.addressable_shards
    # D over fsdp (4), F, the largest free dimension, over data (2): 8 different pieces
    assert {s.data.shape for s in shards} == {(L, D // 4, F // 2)}
    assert len({repr(s.index) for s in shards}) == 8


@pytest.mark.integration
def test_int8_weights_and_gradients_train_within_a_percent(plain_fsdp, small_corpus):
  """data=4 × fsdp=2, both quantized: the losses track plain FSDP's within 1%."""
  config = partitioned(dict(hierarchical=True, weights='int8', gradients='int8'), data=4, fsdp=2)
  curve, _ = train(config, jax.devices(), small_corpus, STEPS)
  ref_curve = plain_fsdp[0]
  assert curve[-1, 0] < curve[0, 0]
  np.testing.assert_allclose(curve[:, 0], ref_curve[:, 0], rtol=1e-2)


@pytest.mark.parametrize('fields,mesh,message', [
    (dict(weights='int8'), dict(data=2, fsdp=4), r"config.partition.weights='int8' quantizes "
                                                 r'.*config.partition.hierarchical=True'),
    (dict(hierarchical=True, gradients='int4'), dict(data=2, fsdp=4),
     r"config.partition.gradients='int4' is not one of"),
    (dict(hierarchical=True), dict(data=1, fsdp=8),
     r'splits the state over config.mesh.data.*it is 1'),
])
def test_partition_settings_that_cannot_work_are_refused_naming_the_setting(fields, mesh,
                                                                            message):
  config = partitioned(fields, **mesh)
  with pytest.raises(ValueError, match=message):
    settings.resolve(config)


def test_a_replica_that_straddles_nodes_moe_lora_and_fp8_are_refused():
  partition = PartitionConfig(hierarchical=True, weights='exact', gradients='exact')
  mesh = dict(data=2, stage=1, fsdp=12, expert=1, tensor=1, sequence=1)
  with pytest.raises(ValueError, match=r'12 devices.*config.mesh.data=6'):
    hierarchical.check_nodes(partition, mesh, gpus_per_node=8)
  hierarchical.check_nodes(partition, dict(mesh, data=1, fsdp=16), gpus_per_node=8)  # whole nodes
  # What it does not run with is known without devices: settings.resolve says so.
  for field, value, message in [('experts', 4, 'does not run MoE models yet'),
                                ('lora_rank', 4, 'only small added parameters train'),
                                ('matmul_precision', 'fp8', "matmul_precision='fp8' yet")]:
    config = partitioned(dict(hierarchical=True), data=2, fsdp=4)
    config.model[field] = value
    with pytest.raises(ValueError, match=message):
      settings.resolve(config)
