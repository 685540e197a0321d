"""The output head and the per-token loss as one operation: each device's tokens against its
vocabulary shard, `config.model.head_chunk` tokens at a time (kernels/cross_entropy.py), so the
logits are never whole; 0 computes them whole (the plain path).

  x[B_(data,fsdp), L_sequence, D] · W[D_(fsdp,sequence), V_tensor] → nll, log Z [B, L] in fp32

The train step takes its loss from `loss_sums`: the weighted sums over the tokens, whose gradient
the chunked path makes in the same pass over the chunks as the loss (no logits computed twice);
`token_losses` gives the per-token figures (evaluation, the draft heads), its backward recomputing
the logits; `greedy_tokens` the top token at each position (what the draft heads learn to guess).

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


def greedy_tokens(x_BLD, w_c, *, tied: bool, chunk: int):
  """The head's top token [B, L] int32 at every position, what greedy decoding would pick there
  (the draft heads' targets: model/draft.py), `chunk` tokens at a time; no gradient."""
  x_BLD, w_c = jax.lax.stop_gradient(x_BLD), jax.lax.stop_gradient(w_c)
  spec = cross_entropy.SPECS[tied]
  if chunk == 0:
    logits_BLV = jnp.einsum(spec.replace('c', 'bl'), x_BLD, w_c,
                            preferred_element_type=jnp.float32)
    return jnp.argmax(logits_BLV, axis=-1).astype(jnp.int32)

  def local(x_BLD, w_c):
    B, L, D = x_BLD.shape
    return cross_entropy.greedy(x_BLD.reshape(B * L, D), w_c, spec=spec, chunk=chunk,
                                vocab_axis=sharding.mesh_axis('vocab')).reshape(B, L)

  return sharding.per_shard(local, (TOKENS + ('embed',), _names(spec)), TOKENS)(x_BLD, w_c)


def loss_sums(x_BLD, w, w_c, targets_BL, weights_BL, *, tied: bool, chunk: int, z_loss: float):
  """(Σ w·(nll + z_loss·log Z²), Σ w·nll, Σ w·log Z²) over the tokens, fp32 scalars: the first is
  the loss the gradient is taken of, the other two (no gradient) its parts for the metrics.
  Chunked, the gradient is made in the forward's pass over the chunks and the backward only
  scales it (kernels/cross_entropy.py: weighted_sums_and_grads); 0 differentiates the plain path."""
  if chunk == 0:
    nll_BL, logz_BL = token_losses(x_BLD, w, w_c, targets_BL, tied=tied, chunk=0)
    nats, log_z2 = (nll_BL * weights_BL).sum(), (jnp.square(logz_BL) * weights_BL).sum()
    loss = nats + z_loss * log_z2
  else:
    loss, nats, log_z2 = _summed(cross_entropy.SPECS[tied], chunk, z_loss, x_BLD, w, w_c,
                                 targets_BL, weights_BL)
  return loss, jax.lax.stop_gradient(nats), jax.lax.stop_gradient(log_z2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _summed(spec, chunk, z_loss, x_BLD, w, w_c, targets_BL, weights_BL):
  return _summed_fwd(spec, chunk, z_loss, x_BLD, w, w_c, targets_BL, weights_BL)[0]


def _summed_fwd(spec, chunk, z_loss, x_BLD, w, w_c, targets_BL, weights_BL):
  tokens, scatter, summed = sharding.token_gradient_axes('the head weight')

  def local(x_BLD, w_c, targets_BL, weights_BL):
    B, L, D = x_BLD.shape
    (nats, log_z2), dx_TD, dw = cross_entropy.weighted_sums_and_grads(
        x_BLD.reshape(B * L, D), w_c, targets_BL.reshape(-1), weights_BL.reshape(-1),
        z_loss=z_loss, spec=spec, chunk=chunk, w_dtype=w.dtype,
        vocab_axis=sharding.mesh_axis('vocab'), scatter_axes=scatter, sum_axes=summed)
    sums = jnp.stack([nats, log_z2])
    return jax.lax.psum(sums, tokens) if tokens else sums, dx_TD.reshape(B, L, D), dw

  x_names = TOKENS + ('embed',)
  sums, dx_BLD, dw = sharding.per_shard(
      local, (x_names, _names(spec), TOKENS, TOKENS),
      [(), x_names, sharding.Params(_names(spec))])(x_BLD, w_c, targets_BL, weights_BL)
  nats, log_z2 = sums[0], sums[1]
  gradients = sharding.varying_like(dx_BLD, x_BLD), sharding.varying_like(dw, w)
  return (nats + z_loss * log_z2, nats, log_z2), gradients


def _summed_bwd(spec, chunk, z_loss, gradients, cotangents):
  """The forward's gradients, scaled by the loss's cotangent (the others' are the metrics',
  stopped by loss_sums)."""
  g = cotangents[0]
  scaled = lambda a: (g * a.astype(jnp.float32)).astype(a.dtype)
  dx_BLD, dw = gradients
  return scaled(dx_BLD), scaled(dw), None, None, None


_summed.defvjp(_summed_fwd, _summed_bwd)


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
