"""A matmul whose backward stays on compute-dtype operands, with fp32 results where asked."""

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
