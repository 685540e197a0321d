"""The output head and the per-token loss as one operation: each device's tokens against its
vocabulary shard, `config.model.head_chunk` tokens at a time (kernels/cross_entropy.py), so the
logits are never whole; 0 computes them whole (the plain path).

  x[B_(data,fsdp), L_sequence, D] · W[D_(fsdp,sequence), V_tensor] → nll, log Z [B, L] in fp32

The weight arrives twice, as kernels/matmul.py takes it: `w` as the parameter (its gradient is
returned in its dtype and sharding, reduce-scattered by the backward itself) and `w_c` gathered
in the compute dtype (used, and kept for the backward).
"""

import functools

import flax.core.spmd
import jax
import jax.numpy as jnp
from flax import nnx

import sharding
from kernels import cross_entropy
from kernels.matmul import matmul

TOKENS = ('batch', 'length')


def token_losses(x_BLD, w, w_c, targets_BL, *, tied: bool, chunk: int, gap: bool = False):
  """(−log p(target), log Z), fp32 [B, L], of the head w (the tied table [V, D], or [D, V]); with
  `gap`, also the largest logit less the target's (0 where the target is the top guess)."""
  if chunk == 0:
    logits_BLV = matmul('bld,vd->blv' if tied else 'bld,dv->blv', x_BLD, w, jnp.float32, w_c)
    return cross_entropy.plain_token_losses(logits_BLV, targets_BL, gap)
  # The backward is traced after the forward returns, outside the caller's rules: it gets them.
  rules = tuple(flax.core.spmd.get_logical_axis_rules())
  losses = _chunked(cross_entropy.SPECS[tied], chunk, rules, x_BLD, w, w_c, targets_BL)
  return losses if gap else losses[:2]


def _names(spec: str) -> tuple:
  return ('embed', 'vocab') if spec == 'cd,dv->cv' else ('vocab', 'embed')


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(spec, chunk, rules, x_BLD, w, w_c, targets_BL):
  del w, rules
  def local(x_BLD, w_c, targets_BL):
    B, L, D = x_BLD.shape
    return tuple(a_T.reshape(B, L) for a_T in cross_entropy.token_losses(
        x_BLD.reshape(B * L, D), w_c, targets_BL.reshape(-1), spec=spec, chunk=chunk,
        vocab_axis=sharding.mesh_axis('vocab')))

  return sharding.per_shard(local, (TOKENS + ('embed',), _names(spec), TOKENS),
                            [TOKENS, TOKENS, TOKENS])(x_BLD, w_c, targets_BL)


def _chunked_fwd(spec, chunk, rules, x_BLD, w, w_c, targets_BL):
  nll_BL, logz_BL, gap_BL = _chunked(spec, chunk, rules, x_BLD, w, w_c, targets_BL)
  return (nll_BL, logz_BL, gap_BL), (x_BLD, w, w_c, targets_BL, logz_BL)


def _chunked_bwd(spec, chunk, rules, residuals, cotangents):
  with nnx.logical_axis_rules(rules):
    return _chunked_grads(spec, chunk, residuals, cotangents)


def _chunked_grads(spec, chunk, residuals, cotangents):
  x_BLD, w, w_c, targets_BL, logz_BL = residuals
  g_nll_BL, g_logz_BL, _ = cotangents  # the gap is a count's, not a loss's: no gradient
  # W's gradient leaves summed over every axis the tokens are split over: reduce-scattered over
  # those that also split its model dimension (FSDP's), summed over the rest.
  _, scatter, summed = sharding.token_gradient_axes('the head weight')

  def local(x_BLD, w_c, targets_BL, logz_BL, g_nll_BL, g_logz_BL):
    B, L, D = x_BLD.shape
    flat = lambda a_BL: a_BL.reshape(-1)
    dx_TD, dw = cross_entropy.token_losses_grads(
        x_BLD.reshape(B * L, D), w_c, flat(targets_BL), flat(logz_BL), flat(g_nll_BL),
        flat(g_logz_BL), spec=spec, chunk=chunk, w_dtype=w.dtype,
        vocab_axis=sharding.mesh_axis('vocab'), scatter_axes=scatter, sum_axes=summed)
    return dx_TD.reshape(B, L, D), dw

  x_names = TOKENS + ('embed',)
  dx_BLD, dw = sharding.per_shard(
      local, (x_names, _names(spec), TOKENS, TOKENS, TOKENS, TOKENS),
      [x_names, sharding.Params(_names(spec))])(x_BLD, w_c, targets_BL, logz_BL, g_nll_BL,
                                                g_logz_BL)
  return sharding.varying_like(dx_BLD, x_BLD), sharding.varying_like(dw, w), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
