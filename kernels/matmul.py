"""A matmul whose backward stays on compute-dtype operands, with fp32 results where asked; and its
fp8 form: operands scaled into float8 (e4m3 forward, e5m2 for gradients) for Hopper's fp8 GEMMs.
"""

import functools

import jax
import jax.numpy as jnp


def _transposed(spec: str) -> tuple[str, str]:
  """The einsum specs of a matmul's two gradients: 'bld,dnh->blnh' → ('blnh,dnh->bld',
  'bld,blnh->dnh')."""
  operands, out = spec.split('->')
  x, w = operands.split(',')
  return f'{out},{w}->{x}', f'{x},{out}->{w}'


def matmul(spec: str, x, w, out_dtype, w_c=None):
  """einsum(spec, x, w) with operands in x's (the compute) dtype, the result in `out_dtype` (GPUs
  accumulate in fp32 either way; a result reduced across devices, as a row-parallel matmul's, is
  reduced in that dtype). Its backward keeps both matmuls on compute-dtype operands too (an fp32
  cotangent, as the logits', is cast first) and returns w's gradient in w's dtype: the dtype in
  which the devices' partial gradients of w are reduced.

  `w_c` is w already cast to the compute dtype (and gathered), used and kept for the backward;
  without it w is cast here and again in the backward, which under FSDP gathers it again rather
  than hold the whole weight from forward to backward."""
  return _matmul(spec, out_dtype, x, w, w_c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(spec, out_dtype, x, w, w_c):
  w_c = w.astype(x.dtype) if w_c is None else w_c
  return jnp.einsum(spec, x, w_c, preferred_element_type=out_dtype)


def _matmul_fwd(spec, out_dtype, x, w, w_c):
  return _matmul(spec, out_dtype, x, w, w_c), (x, w, w_c)


def _matmul_bwd(spec, out_dtype, residuals, g):
  del out_dtype
  x, w, w_c = residuals
  dx_spec, dw_spec = _transposed(spec)
  w_c = w.astype(x.dtype) if w_c is None else w_c
  g = g.astype(x.dtype)
  return (jnp.einsum(dx_spec, g, w_c, preferred_element_type=x.dtype),
          jnp.einsum(dw_spec, x, g, preferred_element_type=w.dtype), None)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2  # forward operands; gradients (more range)


def quantize(x, dtype):
  """(x_q, scale) with x ≈ x_q · scale: current per-tensor scaling, which maps x's largest
  magnitude onto `dtype`'s largest finite value (448 for e4m3, 57344 for e5m2), so nothing
  overflows and the small values keep as many bits as the tensor allows. The scale is fp32; a
  non-finite x gives a non-finite scale and NaNs, for the step's non-finite guard to skip."""
  largest = float(jnp.finfo(dtype).max)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.where(amax > 0, amax / largest, jnp.float32(1))
  return jnp.clip(x.astype(jnp.float32) / scale, -largest, largest).astype(dtype), scale


def dequantize(x_q, scale, dtype):
  """x_q · scale in `dtype`: the form XLA's GPU compiler folds, with the dot it feeds, into one
  cuBLASLt fp8 GEMM that takes the fp8 operands and their scales."""
  return x_q.astype(dtype) * scale.astype(dtype)


def fp8_matmul(spec: str, x, w, out_dtype, w_c=None):
  """matmul (same arguments) with fp8 operands: x and w in e4m3, and in the backward the
  incoming gradient in e5m2, each with its own per-tensor scale (quantize); products are summed
  in fp32 and returned in out_dtype, w's gradient in w's dtype. Kept for the backward: x and w
  in fp8 (half the bytes of bf16), or, without `w_c`, w itself, to be gathered again."""
  return _fp8_matmul(spec, out_dtype, x.dtype, x, w, w_c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_matmul(spec, out_dtype, dtype, x, w, w_c):
  return _fp8_matmul_fwd(spec, out_dtype, dtype, x, w, w_c)[0]


def _fp8_matmul_fwd(spec, out_dtype, dtype, x, w, w_c):
  x_q, x_scale = quantize(x, E4M3)
  w_q, w_scale = quantize(w.astype(dtype) if w_c is None else w_c, E4M3)
  out = jnp.einsum(spec, dequantize(x_q, x_scale, dtype), dequantize(w_q, w_scale, dtype),
                   preferred_element_type=out_dtype)
  # With w_c (gathered, kept from forward to backward) w is kept in fp8; without, only the
  # sharded w is, to be gathered again.
  return out, (x_q, x_scale, (w_q, w_scale) if w_c is not None else None, w)


def _fp8_matmul_bwd(spec, out_dtype, dtype, residuals, g):
  del out_dtype
  x_q, x_scale, kept, w = residuals
  w_q, w_scale = quantize(w.astype(dtype), E4M3) if kept is None else kept
  g_q, g_scale = quantize(g, E5M2)
  g_c = dequantize(g_q, g_scale, dtype)
  dx_spec, dw_spec = _transposed(spec)
  return (jnp.einsum(dx_spec, g_c, dequantize(w_q, w_scale, dtype), preferred_element_type=dtype),
          jnp.einsum(dw_spec, dequantize(x_q, x_scale, dtype), g_c,
                     preferred_element_type=w.dtype), None)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)
