"""Our Pallas grouped matmul (kernels/grouped_matmul.py, interpret mode on CPU) against a dense
one-hot reference and XLA's ragged_dot: values and both gradients, with ragged, empty and
boundary-crossing groups and padding rows; and compiled for H100s that are not here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.grouped_matmul import Blocks, grouped_matmul
from planning import gpu_compiler, gpus

SMALL = Blocks(bm=16, bk=16, bn=16)  # several tiles, and tiles crossed by group boundaries
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def values_and_grads(implementation, x_MK, w_GKN, sizes_G, dy_MN):
  def loss(x, w):
    y = grouped_matmul(x, w, sizes_G, implementation=implementation, blocks=SMALL)
    return (y.astype(jnp.float32) * dy_MN).sum(), y
  (_, y), (dx, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x_MK, w_GKN)
  return y, dx, dw


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('sizes', [(17, 0, 40, 3, 30),  # ragged, one empty, 10 padding rows
                                   (0, 100, 0, 0, 0),  # every row in one group
                                   (0, 0, 0, 0, 0)])  # no rows routed: all zeros
def test_values_and_both_gradients_equal_the_references(dtype, sizes):
  M, K, N = 100, 32, 48  # M not a whole number of tiles: padded inside
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (M, K), dtype)
  w = jax.random.normal(keys[1], (len(sizes), K, N), dtype)
  dy = jax.random.normal(keys[2], (M, N), jnp.float32)
  sizes_G = jnp.array(sizes, jnp.int32)
  ours = values_and_grads('pallas', x, w, sizes_G, dy)
  tol = TOLERANCE[dtype]
  for reference in ('dense', 'ragged_dot'):
    for name, a, b in zip(('y', 'dx', 'dw'), ours, values_and_grads(reference, x, w, sizes_G, dy)):
      assert a.shape == b.shape and a.dtype == b.dtype == dtype, (name, reference)
      scale = max(1.0, float(jnp.abs(b.astype(jnp.float32)).max()))
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 atol=tol * scale, rtol=tol, err_msg=f'{name} vs {reference}')
  routed = sum(sizes)
  assert not np.any(np.asarray(ours[0][routed:], np.float32)), 'rows past the groups are zeros'
  assert not np.any(np.asarray(ours[1][routed:], np.float32))
  for g, size in enumerate(sizes):
    if size == 0:
      assert not np.any(np.asarray(ours[2][g], np.float32)), 'an empty group has no gradient'


@pytest.mark.integration
def test_compiles_for_h100_with_no_spills_and_no_dense_expert_buffer():
  """At Mixtral's expert width: forward, dx and dw as Triton kernels for sm_90a, within shared
  memory, no register spills, and no buffer as large as every token times every expert."""
  assert gpu_compiler.in_this_process()
  device, = gpu_compiler.devices(gpus.GPUS['H100'], 1)
  place = jax.sharding.SingleDeviceSharding(device)
  M, K, N, G = 8192, 4096, 1024, 8  # tokens × experts per token, d_model, a tensor share of 14336
  x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=place)
  w = jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16, sharding=place)
  sizes = jax.ShapeDtypeStruct((G,), jnp.int32, sharding=place)

  def loss(x, w, sizes):
    return grouped_matmul(x, w, sizes).astype(jnp.float32).sum()

  lowered = gpu_compiler.lower(device, jax.jit(jax.grad(loss, (0, 1))), x, w, sizes)
  found = {k.name: k for k in gpu_compiler.kernels(lowered)}
  assert {'grouped_matmul', 'grouped_matmul_dw'} <= set(found), sorted(found)
  limit = gpus.GPUS['H100'].shared_memory_per_block_optin
  for name in ('grouped_matmul', 'grouped_matmul_dw'):
    k = found[name]
    assert k.spill_stores == k.spill_loads == 0 and 0 < k.registers <= 255, k
    assert 0 < k.shared_memory <= limit, k
  temp = lowered.compile().memory_analysis().temp_size_in_bytes
  assert temp < M * G * N * 2, f'{temp} bytes of temporaries: a dense [M, G, N] bf16 buffer fits'
