"""fp8 projections (config.model.matmul_precision='fp8', kernels/matmul.py): scaling against a
NumPy reference, overflow, and training. That it lowers to cuBLASLt's fp8 GEMMs on H100s is
tests/test_gpu_compile.py's."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels.matmul import E4M3, E5M2, fp8_matmul, quantize
from tests.conftest import tiny_config
from tests.test_sharding import train_losses


def reference_quantize(x, dtype):
  """Current per-tensor scaling in NumPy (ml_dtypes' float8, round to nearest even)."""
  largest = float(ml_dtypes.finfo(dtype).max)
  amax = np.abs(x).max()
  scale = np.float32(amax / largest) if amax > 0 else np.float32(1)
  return np.clip(x / scale, -largest, largest).astype(dtype), scale


def dequantized(x_q, scale):
  return x_q.astype(np.float32) * scale


@pytest.mark.parametrize('dtype', [E4M3, E5M2], ids=['e4m3', 'e5m2'])
@pytest.mark.parametrize('magnitude', [1e-6, 1.0, 3e4])
def test_scales_match_numpy_and_the_largest_value_lands_on_the_format_maximum(dtype, magnitude):
  x = (np.random.default_rng(0).standard_normal((64, 48)) * magnitude).astype(np.float32)
  x_q, scale = quantize(jnp.asarray(x), dtype)
  ref_q, ref_scale = reference_quantize(x, dtype)
  assert np.float32(scale) == ref_scale
  np.testing.assert_array_equal(np.asarray(x_q).view(np.uint8), ref_q.view(np.uint8))
  at = np.unravel_index(np.abs(x).argmax(), x.shape)
  assert abs(float(np.asarray(x_q)[at].astype(np.float32))) == float(ml_dtypes.finfo(dtype).max)
  relative = np.abs(dequantized(np.asarray(x_q), ref_scale) - x) / np.abs(x).max()
  assert relative.max() < {E4M3: 2**-4, E5M2: 2**-3}[dtype]  # within the format's step


def test_overflow_cannot_reach_the_weights():
  """Values past bf16's range scale down rather than overflow; a non-finite input makes NaNs,
  which the step's non-finite guard skips (tests/test_checkpoint.py), never an inf."""
  x = np.array([[1e38, -3e38, 1.0, 0.0]], np.float32)
  x_q, scale = quantize(jnp.asarray(x), E4M3)
  assert np.isfinite(np.asarray(x_q).astype(np.float32)).all() and np.isfinite(float(scale))
  zeros_q, zero_scale = quantize(jnp.zeros((3, 3)), E4M3)
  assert float(zero_scale) == 1 and not np.asarray(zeros_q).astype(np.float32).any()
  for bad in (np.inf, np.nan):
    x_q, scale = quantize(jnp.asarray([[bad, 1.0]], jnp.float32), E4M3)
    assert not np.isfinite(dequantized(np.asarray(x_q), np.float32(scale))).all()
    assert not np.isinf(dequantized(np.asarray(x_q), np.float32(scale))).any()


@pytest.mark.parametrize('keep_gathered', [True, False])
def test_forward_and_gradients_match_numpy(keep_gathered):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 8, 16)).astype(np.float32)
  w = (rng.standard_normal((16, 12)) * 0.1).astype(np.float32)
  g = (rng.standard_normal((2, 8, 12)) * 1e-3).astype(np.float32)

  def f(x, w):
    return fp8_matmul('bld,df->blf', x, w, jnp.float32, w if keep_gathered else None)

  out, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
  dx, dw = vjp(jnp.asarray(g))
  x_q, w_q, g_q = (dequantized(*reference_quantize(a, t))
                   for a, t in ((x, E4M3), (w, E4M3), (g, E5M2)))
  np.testing.assert_allclose(out, np.einsum('bld,df->blf', x_q, w_q), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx, np.einsum('blf,df->bld', g_q, w_q), rtol=1e-5, atol=1e-9)
  np.testing.assert_allclose(dw, np.einsum('bld,blf->df', x_q, g_q), rtol=1e-5, atol=1e-9)
  exact = np.einsum('bld,df->blf', x, w)
  assert np.abs(np.asarray(out) - exact).max() < 0.1 * np.abs(exact).max()  # fp8, not garbage


def fp8(config):
  config.model.matmul_precision = 'fp8'
  return config


@pytest.mark.integration
def test_fp8_training_is_the_same_sharded_and_tracks_the_default_precision(small_corpus):
  """Per-tensor scales are global (amax is exact in any order), so a sharded fp8 step equals one
  device's; later steps part a little, as reordered fp32 sums round to other fp8 values. And
  fp8 follows the compute dtype's curve."""
  one, _ = train_losses(fp8(tiny_config()), jax.devices()[:1], small_corpus)
  sharded, _ = train_losses(fp8(tiny_config(data=2, fsdp=2, tensor=2)), jax.devices(),
                            small_corpus)
  default, _ = train_losses(tiny_config(data=2, fsdp=2, tensor=2), jax.devices(), small_corpus)
  np.testing.assert_allclose(sharded[0], one[0], rtol=2e-5)  # loss and gradient norm
  np.testing.assert_allclose(sharded, one, rtol=0.01)
  assert one[-1, 0] < one[0, 0]  # learning
  np.testing.assert_allclose(one[:, 0], default[:, 0], rtol=0.01)
