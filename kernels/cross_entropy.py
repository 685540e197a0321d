"""The output head and its cross-entropy as one operation that never holds more than a chunk of
logits.

On each device's own tokens (the caller runs these per shard, model/head.py), `chunk` tokens at a
time: the chunk's logits x·W in the compute dtype with fp32 accumulation, their log-sum-exp over
the vocabulary (its shards along `vocab_axis` combined by a max and a sum across devices), and
the target's logit (from the shard that holds it). Out come per-token log Z and −log p(target) in
fp32, [T] each, and how far the target's logit lies below the largest (0 where the target is the
top-1 guess: what accuracy counts); weights and the z-loss are the caller's, in fp32. A
[chunk, V/shards] fp32 block is the largest thing made: the 8b preset's 32,768 tokens × 128,256 vocabulary a device (15.7 GiB
of fp32 logits, and as much again for their gradient) become 4,096 × 128,256 (2 GiB) at the
default chunk.

The backward of token_losses recomputes each chunk's logits from x and W (one head matmul more
than a backward that kept them). A loss that sums weighted tokens needs no backward of its own:
weighted_sums_and_grads makes its gradient in the forward's pass over the chunks, from the
logits the loss was computed from (the train step's loss, model/head.py: loss_sums). Either forms
dlogits = (g_nll + g_logz)·softmax − g_nll·onehot(target) in fp32, cast
to the compute dtype for dx = dlogits·Wᵀ (summed over the vocabulary's shards) and dW += xᵀ·dlogits
(fp32 across chunks). dW then leaves summed over the token axes and split as the weight is
(`scatter_axes`: a reduce-scatter into its FSDP shards, `sum_axes`: the rest), in the weight's
dtype: the one its partial sums cross devices in, as kernels/matmul.py's do.

W is [D, V] (spec 'cd,dv->cv', an untied head) or [V, D] ('cd,vd->cv', the tied table).
"""

import jax
import jax.numpy as jnp

SPECS = ('cd,dv->cv', 'cd,vd->cv')


def _dims(spec: str) -> tuple[int, int]:
  """(the vocabulary's, the model dimension's) dimension of W."""
  return (1, 0) if spec == 'cd,dv->cv' else (0, 1)


def _in_chunks(chunk: int, *arrays_T):
  """Each [T, ...] array as [n, chunk, ...], zero-padded to n·chunk rows."""
  T = arrays_T[0].shape[0]
  n = -(-T // chunk)
  return [jnp.pad(a, [(0, n * chunk - T)] + [(0, 0)] * (a.ndim - 1))
          .reshape(n, chunk, *a.shape[1:]) for a in arrays_T]


def _local_targets(targets_C, w, spec, vocab_axis):
  """The targets as indices into this device's vocabulary shard, and whether they fall in it."""
  vocab = w.shape[_dims(spec)[0]]
  offset = jax.lax.axis_index(vocab_axis) * vocab if vocab_axis else 0
  local_C = targets_C - offset
  return local_C, (local_C >= 0) & (local_C < vocab)


def _over_vocab(reduce, x, vocab_axis):
  return reduce(x, vocab_axis) if vocab_axis else x


def _max_and_sum_exp(logits_CV):
  """Each row's largest logit m and Σ exp(logit − m), in one pass over the logits (a running
  pair, rescaled as the maximum grows): a max and then a sum of exponentials read them twice."""
  def combine(a, b):
    (m_a, s_a), (m_b, s_b) = a, b
    m = jnp.maximum(m_a, m_b)
    return m, s_a * jnp.exp(m_a - m) + s_b * jnp.exp(m_b - m)
  # The identity starts at the lowest finite float, not −inf: two untouched partial pairs
  # combine to (lowest, 0), where −inf would give 0·exp(nan).
  lowest = jnp.finfo(logits_CV.dtype).min
  return jax.lax.reduce((logits_CV, jnp.ones_like(logits_CV)),
                        (jnp.asarray(lowest, logits_CV.dtype), jnp.zeros((), logits_CV.dtype)),
                        combine, (1,))


def _chunk_losses(x_CD, w_c, targets_C, spec, vocab_axis):
  """A chunk's fp32 logits [C, V/shards], and per token its log Z, largest logit and target's
  logit (the vocabulary's shards combined)."""
  logits_CV = jnp.einsum(spec, x_CD, w_c, preferred_element_type=jnp.float32)
  shard_max_C, shard_sum_C = _max_and_sum_exp(logits_CV)
  max_C = _over_vocab(jax.lax.pmax, shard_max_C, vocab_axis)
  sum_C = _over_vocab(jax.lax.psum, shard_sum_C * jnp.exp(shard_max_C - max_C), vocab_axis)
  local_C, here_C = _local_targets(targets_C, w_c, spec, vocab_axis)
  index_C1 = jnp.clip(local_C, 0, logits_CV.shape[1] - 1)[:, None]
  picked_C = jnp.take_along_axis(logits_CV, index_C1, axis=-1)[:, 0]
  target_logit_C = _over_vocab(jax.lax.psum, jnp.where(here_C, picked_C, 0.0), vocab_axis)
  return logits_CV, max_C + jnp.log(sum_C), max_C, target_logit_C


def _chunk_grads(x_CD, w_c, logits_CV, logz_C, targets_C, g_nll_C, g_logz_C, spec, vocab_axis):
  """A chunk's dx (summed over the vocabulary's shards) and its fp32 term of dW, for the
  cotangents g_nll_C, g_logz_C: dlogits = (g_nll + g_logz)·softmax − g_nll·onehot(target)."""
  w_spec = spec.split('->')[0].split(',')[1]
  probs_CV = jnp.exp(logits_CV - logz_C[:, None])
  local_C, here_C = _local_targets(targets_C, w_c, spec, vocab_axis)
  onehot_CV = (jnp.arange(logits_CV.shape[1]) == local_C[:, None]) & here_C[:, None]
  d_logits_CV = ((g_nll_C + g_logz_C)[:, None] * probs_CV
                 - jnp.where(onehot_CV, g_nll_C[:, None], 0.0)).astype(x_CD.dtype)
  dx_CD = jnp.einsum(f'cv,{w_spec}->cd', d_logits_CV, w_c, preferred_element_type=x_CD.dtype)
  dw_f32 = jnp.einsum(f'cd,cv->{w_spec}', x_CD, d_logits_CV, preferred_element_type=jnp.float32)
  return _over_vocab(jax.lax.psum, dx_CD, vocab_axis), dw_f32


def _weight_gradient(dw_f32, spec, w_dtype, scatter_axes, sum_axes):
  """dW in `w_dtype`, reduce-scattered over `scatter_axes` along W's model dimension and summed
  over `sum_axes`."""
  dw = dw_f32.astype(w_dtype)
  if scatter_axes:
    dw = jax.lax.psum_scatter(dw, scatter_axes, scatter_dimension=_dims(spec)[1], tiled=True)
  if sum_axes:
    dw = jax.lax.psum(dw, sum_axes)
  return dw


def token_losses(x_TD, w_c, targets_T, *, spec: str, chunk: int, vocab_axis: str | None = None):
  """(−log p(target), log Z, max logit − target's logit), fp32 [T] each, of tokens x_TD under the
  head w_c (the compute dtype; this device's vocabulary shard along `vocab_axis`, if split),
  `chunk` tokens at a time."""
  def one_chunk(_, xs):
    x_CD, targets_C = xs
    _, logz_C, max_C, target_logit_C = _chunk_losses(x_CD, w_c, targets_C, spec, vocab_axis)
    return None, (logz_C - target_logit_C, logz_C, max_C - target_logit_C)

  T = x_TD.shape[0]
  _, out = jax.lax.scan(one_chunk, None, _in_chunks(chunk, x_TD, targets_T))
  return tuple(a_nC.reshape(-1)[:T] for a_nC in out)


def token_losses_grads(x_TD, w_c, targets_T, logz_T, g_nll_T, g_logz_T, *, spec: str, chunk: int,
                       w_dtype, vocab_axis: str | None = None, scatter_axes: tuple = (),
                       sum_axes: tuple = ()):
  """(dx_TD, dW) of token_losses for the cotangents g_nll_T, g_logz_T: dx in x's dtype, dW in
  `w_dtype`, summed over `sum_axes` and reduce-scattered over `scatter_axes` along W's model
  dimension (module docstring)."""
  def one_chunk(dw_f32, xs):
    x_CD, targets_C, logz_C, g_nll_C, g_logz_C = xs
    logits_CV = jnp.einsum(spec, x_CD, w_c, preferred_element_type=jnp.float32)
    dx_CD, dw_C = _chunk_grads(x_CD, w_c, logits_CV, logz_C, targets_C, g_nll_C, g_logz_C, spec,
                               vocab_axis)
    return dw_f32 + dw_C, dx_CD

  T = x_TD.shape[0]
  # Zeros like W vary over a manual region's axes (a pipeline stage's) as W does, and so as the
  # chunks' terms do (the stages pass W in as their own, model/transformer.py).
  dw_f32, dx_nCD = jax.lax.scan(one_chunk, jnp.zeros_like(w_c, jnp.float32),
                                _in_chunks(chunk, x_TD, targets_T, logz_T, g_nll_T, g_logz_T))
  return (dx_nCD.reshape(-1, x_TD.shape[1])[:T],
          _weight_gradient(dw_f32, spec, w_dtype, scatter_axes, sum_axes))


def weighted_sums_and_grads(x_TD, w_c, targets_T, weights_T, *, z_loss: float, spec: str,
                            chunk: int, w_dtype, vocab_axis: str | None = None,
                            scatter_axes: tuple = (), sum_axes: tuple = ()):
  """A loss that sums weighted tokens, with its gradient made in the same pass over the chunks:
  ((Σ w·nll, Σ w·log Z²) over these tokens in fp32, dx_TD, dW) for the loss Σ w·(nll + z_loss·
  log Z²), dx and dW as token_losses_grads leaves them. Each chunk's logits serve the loss and
  its gradient at once, so no head matmul is computed twice (token_losses then
  token_losses_grads compute the logits twice), and nothing of the chunk outlives it."""
  def one_chunk(carry, xs):
    dw_f32, nats, log_z2 = carry
    x_CD, targets_C, weights_C = xs
    logits_CV, logz_C, _, target_logit_C = _chunk_losses(x_CD, w_c, targets_C, spec, vocab_axis)
    dx_CD, dw_C = _chunk_grads(x_CD, w_c, logits_CV, logz_C, targets_C, weights_C,
                               2 * z_loss * weights_C * logz_C, spec, vocab_axis)
    sums = (nats + (weights_C * (logz_C - target_logit_C)).sum(),
            log_z2 + (weights_C * jnp.square(logz_C)).sum())
    return (dw_f32 + dw_C, *sums), dx_CD

  T = x_TD.shape[0]
  zero = jnp.zeros((), jnp.float32)
  (dw_f32, nats, log_z2), dx_nCD = jax.lax.scan(
      one_chunk, (jnp.zeros_like(w_c, jnp.float32), zero, zero),
      _in_chunks(chunk, x_TD, targets_T, weights_T.astype(jnp.float32)))
  return ((nats, log_z2), dx_nCD.reshape(-1, x_TD.shape[1])[:T],
          _weight_gradient(dw_f32, spec, w_dtype, scatter_axes, sum_axes))


def greedy(x_TD, w_c, *, spec: str, chunk: int, vocab_axis: str | None = None):
  """The head's top token [T] int32 for tokens x_TD (what greedy decoding picks), `chunk` tokens
  at a time; the vocabulary's shards combined, the lowest id among equal logits as argmax takes."""
  def one_chunk(_, x_nCD):
    x_CD, = x_nCD
    logits_CV = jnp.einsum(spec, x_CD, w_c, preferred_element_type=jnp.float32)
    shard_max_C = logits_CV.max(axis=-1)
    offset = jax.lax.axis_index(vocab_axis) * logits_CV.shape[1] if vocab_axis else 0
    ids_C = jnp.argmax(logits_CV, axis=-1).astype(jnp.int32) + offset
    max_C = _over_vocab(jax.lax.pmax, shard_max_C, vocab_axis)
    ids_C = jnp.where(shard_max_C == max_C, ids_C, jnp.iinfo(jnp.int32).max)
    return None, _over_vocab(jax.lax.pmin, ids_C, vocab_axis)

  T = x_TD.shape[0]
  _, ids_nC = jax.lax.scan(one_chunk, None, _in_chunks(chunk, x_TD))
  return ids_nC.reshape(-1)[:T]


def plain_token_losses(logits_TV, targets_T, gap: bool = False):
  """token_losses from logits already whole (the plain path, config.model.head_chunk=0): the
  first two, or with `gap` all three."""
  logz_T = jax.nn.logsumexp(logits_TV, axis=-1)
  target_logit_T = jnp.take_along_axis(logits_TV, targets_T[..., None], axis=-1)[..., 0]
  losses = logz_T - target_logit_T, logz_T
  return (*losses, logits_TV.max(axis=-1) - target_logit_T) if gap else losses

