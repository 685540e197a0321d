"""The attention dispatch point: every attention call in the model goes through `attention`.

Layout follows `jax.nn.dot_product_attention`:
  q[B, L, N, H], k and v [B, S, K, H] with N a multiple of K (grouped-query attention: each of the
  K key/value heads serves G = N // K query heads, without copying K/V), output [B, L, N, H].
Segment ids mark packed documents: a query attends only to keys with the same segment id. A
`window` W (causal only: a local layer's sliding window) lets a query see only the W keys ending
at its own position; an int, or an int32 scalar known at run time (0: no window), for the XLA
path and ours.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
# cuDNN's packed layout (documents at offsets in a row) is not in jax.nn.dot_product_attention:
# JAX's cuDNN module has it, at the jax this project pins (pyproject.toml).
from jax._src.cudnn import fused_attention_stablehlo as fused_attention

from configs.base import ATTENTION_KERNELS, OUR_ATTENTION
from kernels.flash_attention import flash_attention, hopper_blocks
from kernels.matmul import matmul

# config.model.attention's kernels (configs/base.py declares the names). Ours, in Triton (any
# NVIDIA GPU) and in Mosaic GPU (Hopper's sm_90a): run per shard, and over a split length (context
# parallelism). Neither stores the [L, S] scores; both interpret on CPU.
IMPLEMENTATIONS, OURS = ATTENTION_KERNELS, OUR_ATTENTION
FUSED = ('cudnn', *OURS)


def hopper_refuses(head_dim: int, compute_dtype: str) -> str | None:
  """Why our Hopper kernel cannot run this attention (None: it can): wgmma takes bf16 or fp16
  operands, and the kernel head dims in multiples of 64 up to 256."""
  if head_dim % 64 or head_dim > 256:
    return f'head_dim={head_dim} (it takes multiples of 64 up to 256)'
  if compute_dtype not in ('bfloat16', 'float16'):
    return f'compute_dtype={compute_dtype!r} (it takes bfloat16 or float16)'
  return None


def length_tile(model_cfg) -> int:
  """Positions that each call of config.model's attention must take in whole blocks of: the
  Hopper kernel's key block (it masks no padding; kernels/flash_attention.py pads for the
  others), 1 for every other implementation."""
  if model_cfg.attention != 'hopper':
    return 1
  return max(64, model_cfg.attention_block_k or hopper_blocks(model_cfg.head_dim)[1])


def fused_for(head_dim: int, compute_dtype: str, length_split: bool,
              hopper: bool = False, windows: str = 'none', lse: bool = False) -> tuple[str, ...]:
  """The fused implementations that run this attention on an NVIDIA GPU, Hopper's (sm_90a)
  when `hopper`. cuDNN's flash attention takes head dims up to 128 in multiples of 8, in bf16 or
  fp16, a window fixed when compiled (`windows`: config.model's) and no split length (XLA
  partitions it whole); ours in Triton takes any of these, ours in Mosaic GPU what
  `hopper_refuses` does not refuse. `lse`: each query's log-sum-exp is
  wanted too (QK-clip's), which cuDNN's path does not give yet."""
  cudnn = (head_dim <= 128 and head_dim % 8 == 0 and compute_dtype in ('bfloat16', 'float16')
           and not length_split and windows != 'mixed' and not lse)
  ours = OURS if hopper and not hopper_refuses(head_dim, compute_dtype) else ('pallas',)
  return (('cudnn',) if cudnn else ()) + ours


def attention(q_BLNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids_BL=None, kv_segment_ids_BS=None,
              implementation: str = 'xla', block_q: int = 0, block_k: int = 0,
              cudnn_segments: int = 0, window=None, with_lse: bool = False):
  """Scaled dot-product attention with `implementation` in IMPLEMENTATIONS; with `with_lse`,
  (out, lse[B, N, L]): each query's log-sum-exp of its scaled scores (an upper bound of its
  largest, within log(keys it sees); QK-clip's measure), without a gradient, from xla and ours.

  `kv_segment_ids_BS` defaults to `segment_ids_BL` (self-attention over one packed row).
  pallas and hopper (ours, kernels/flash_attention.py): `block_q`, `block_k` (0: the kernel's
  default for the head_dim). XLA cannot partition a Pallas call: under a mesh, run it per shard
  (sharding.per_shard).
  cudnn only: `cudnn_segments`, the most documents a packed row may hold for cuDNN's packed
  layout (0: always the dense mask; _cudnn_attention).
  """
  if segment_ids_BL is not None and kv_segment_ids_BS is None:
    kv_segment_ids_BS = segment_ids_BL
  if window is not None and not causal:
    raise ValueError('attention: a window is for causal attention (a local layer\'s)')
  if implementation == 'xla':
    return xla_attention(q_BLNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BL=segment_ids_BL,
                         kv_segment_ids_BS=kv_segment_ids_BS, window=window, with_lse=with_lse)
  if implementation == 'cudnn' and with_lse:
    raise ValueError("attention: cuDNN's path gives no log-sum-exp yet; use ours or xla")
  if implementation == 'cudnn':
    if window is not None and not isinstance(window, int):
      raise ValueError('attention: cuDNN takes a window fixed when compiled, not one known only '
                       'at run time (local and global layers scanned alike); use ours or xla')
    return _cudnn_attention(q_BLNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BL=segment_ids_BL,
                            kv_segment_ids_BS=kv_segment_ids_BS, segments=cudnn_segments,
                            window=window)
  if implementation in OURS:
    return flash_attention(q_BLNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BL=segment_ids_BL,
                           kv_segment_ids_BS=kv_segment_ids_BS, block_q=block_q, block_k=block_k,
                           hopper=implementation == 'hopper', window=window,
                           with_lse=with_lse)
  raise ValueError(f'attention implementation {implementation!r} is not one of {IMPLEMENTATIONS}')


def xla_attention(q_BLNH, k_BSKH, v_BSKH, *, causal, segment_ids_BL=None, kv_segment_ids_BS=None,
                  window=None, with_lse: bool = False):
  """The reference: plain einsums and an fp32 softmax, materialising the [L, S] scores."""
  if segment_ids_BL is not None and kv_segment_ids_BS is None:
    kv_segment_ids_BS = segment_ids_BL
  B, L, S = q_BLNH.shape[0], q_BLNH.shape[1], k_BSKH.shape[1]
  return masked_attention(q_BLNH, k_BSKH, v_BSKH,
                          _mask(B, L, S, causal, segment_ids_BL, kv_segment_ids_BS, window),
                          with_lse)


def within(distance, window):
  """Where a key `distance` positions before its query is inside `window` (None or 0: all)."""
  if window is None:
    return True
  if isinstance(window, int):
    return distance < window
  return (window <= 0) | (distance < window)


def cached_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT, window=None):
  """Decoding against a KV cache of S slots: query t of row b, at position positions_BT[b, t],
  attends to the slots 0 … that position (slot s holds position s's key and value), within the
  last `window` of them where given."""
  distance_BTS = positions_BT[:, :, None] - jnp.arange(k_BSKH.shape[1])[None, None, :]
  mask_BTS = (distance_BTS >= 0) & within(distance_BTS, window)
  return masked_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS)


def positioned_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT, key_positions_BS, window=None):
  """Decoding against keys at `key_positions_BS` (< 0: no key there), as a ring of a local
  layer's cache holds them: query t of row b, at position positions_BT[b, t], attends to the
  keys at or before it, within the last `window` positions where given."""
  distance_BTS = positions_BT[:, :, None] - key_positions_BS[:, None, :]
  mask_BTS = ((key_positions_BS[:, None, :] >= 0) & (distance_BTS >= 0)
              & within(distance_BTS, window))
  return masked_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS)


def masked_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLS, with_lse: bool = False):
  """Softmax attention where boolean `mask_BLS` (True = attend; None = all) allows; with
  `with_lse`, and each query's log-sum-exp of its scores [B, N, L] (no gradient)."""
  B, L, N, H = q_BLNH.shape
  K = k_BSKH.shape[2]
  G = N // K
  q_BLKGH = q_BLNH.reshape(B, L, K, G, H)
  # fp32 scores and softmax; every matmul, backward too, on the compute dtype (kernels/matmul.py).
  scores_BKGLS = matmul('blkgh,bskh->bkgls', q_BLKGH, k_BSKH, jnp.float32) \
      / np.sqrt(H).astype(np.float32)
  if mask_BLS is not None:
    # A large finite negative rather than -inf: a fully masked row gives zeros, never NaN.
    scores_BKGLS = jnp.where(mask_BLS[:, None, None], scores_BKGLS, -0.7 * np.finfo(np.float32).max)
  probs_BKGLS = jax.nn.softmax(scores_BKGLS, axis=-1)
  if mask_BLS is not None:
    probs_BKGLS = jnp.where(mask_BLS[:, None, None], probs_BKGLS, 0.0)
  out_BLKGH = matmul('bkgls,bskh->blkgh', probs_BKGLS.astype(v_BSKH.dtype), v_BSKH, jnp.float32)
  out_BLNH = out_BLKGH.reshape(B, L, N, H).astype(q_BLNH.dtype)
  if not with_lse:
    return out_BLNH
  lse_BKGL = jax.nn.logsumexp(jax.lax.stop_gradient(scores_BKGLS), axis=-1)
  return out_BLNH, lse_BKGL.reshape(B, N, L)


def _mask(B, L, S, causal, segment_ids_BL, kv_segment_ids_BS, window=None):
  """Boolean [B, L, S] (True = attend) or None when nothing is masked."""
  mask = None
  if causal:
    # Queries are the last L positions of the S keys (L == S for training).
    distance = jnp.arange(L)[:, None] + (S - L) - jnp.arange(S)[None, :]
    mask = jnp.broadcast_to((distance >= 0) & within(distance, window), (B, L, S))
  if segment_ids_BL is not None:
    same = segment_ids_BL[:, :, None] == kv_segment_ids_BS[:, None, :]
    mask = same if mask is None else mask & same
  return mask


# The op name that marks cuDNN's dense-mask fallback for rows of more documents than the packed
# layout holds: the time model charges a step the packed branch it takes (planning/timing.py).
DENSE_FALLBACK = 'cudnn_dense_mask_fallback'


def _cudnn_attention(q_BLNH, k_BSKH, v_BSKH, *, causal, segment_ids_BL, kv_segment_ids_BS,
                     segments: int = 0, window: int | None = None):
  """cuDNN's fused flash attention. Packed rows (segment ids, self-attention, causal) take its
  packed layout when every row of the batch is laid out as data/packing.py lays rows (documents
  numbered 1, 2, … end to end, padding 0 at the end) in at most `segments` documents, padding
  counted as one: each attends within itself and the blocks between documents are skipped.
  Otherwise cuDNN takes the segment mask as a dense [B, 1, L, S] bias (1.6–1.75× the kernels'
  time, planning/gpus.py: CUDNN_BIAS_SLOWDOWN). A `window` is cuDNN's sliding window (its
  left edge: the window's keys before the query's own)."""
  attend = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation='cudnn',
                             local_window_size=None if window is None else (window - 1, 0))
  if segment_ids_BL is None:
    return attend(q_BLNH, k_BSKH, v_BSKH)

  def dense(q, k, v, ids_BL, kv_ids_BS):
    with jax.named_scope(DENSE_FALLBACK):
      return attend(q, k, v, mask=(ids_BL[:, :, None] == kv_ids_BS[:, None, :])[:, None])

  if not (segments and causal and kv_segment_ids_BS is segment_ids_BL):
    return dense(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, kv_segment_ids_BS)
  laid_out, starts_BM1, lengths_BM = packed_layout(segment_ids_BL, segments)

  def packed(q, k, v, ids_BL, kv_ids_BS):
    return fused_attention.dot_product_attention(
        q, k, v, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=starts_BM1,
        kv_offsets=starts_BM1, scale=1 / np.sqrt(q.shape[-1]),
        mask_type=fused_attention.MaskType.PADDING_CAUSAL, qkv_layout='BTNH',
        **({} if window is None else {'sliding_window_length': window}))

  return jax.lax.cond(laid_out, packed, dense, q_BLNH, k_BSKH, v_BSKH, segment_ids_BL,
                      kv_segment_ids_BS)


def packed_layout(segment_ids_BL, segments: int):
  """(whether every row is laid out for cuDNN's packed layout, each row's document starts
  [B, segments + 1] and lengths [B, segments], -1 past its last). A row is laid out when its ids
  run 1, 2, … by steps of one, then padding (0) to its end, in at most `segments` documents with
  the padding as one more: padding attends to padding, as under the dense mask, and every token
  is in a document (a token in none gets NaN gradients from cuDNN)."""
  B, L = segment_ids_BL.shape
  padding = segment_ids_BL.max(axis=1, keepdims=True) + 1
  ids_BL = jnp.where(segment_ids_BL == 0, padding, segment_ids_BL)
  steps_BL = jnp.diff(ids_BL, axis=1)
  laid_out = ((ids_BL[:, 0] == 1).all() & ((steps_BL == 0) | (steps_BL == 1)).all()
              & (ids_BL[:, -1] <= segments).all())
  lengths_BM = (ids_BL[:, None, :] == jnp.arange(1, segments + 1)[None, :, None]).sum(
      -1, dtype=jnp.int32)
  starts_BM = jnp.cumsum(lengths_BM, axis=1, dtype=jnp.int32) - lengths_BM
  present_BM = lengths_BM > 0
  starts_BM1 = jnp.concatenate([jnp.where(present_BM, starts_BM, -1),
                                jnp.full((B, 1), -1, jnp.int32)], axis=1)
  return laid_out, starts_BM1, jnp.where(present_BM, lengths_BM, -1)
