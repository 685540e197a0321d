"""The attention dispatch point: every attention call in the model goes through `attention`.

Layout follows `jax.nn.dot_product_attention`:
  q[B, L, N, H], k and v [B, S, K, H] with N a multiple of K (grouped-query attention: each of the
  K key/value heads serves G = N // K query heads, without copying K/V), output [B, L, N, H].
Segment ids mark packed documents: a query attends only to keys with the same segment id.
"""

import jax
import jax.numpy as jnp
import numpy as np

from kernels.flash_attention import flash_attention
from kernels.matmul import matmul

IMPLEMENTATIONS = ('xla', 'cudnn', 'pallas')
FUSED = ('cudnn', 'pallas')  # never store the [L, S] scores; GPU only (pallas interprets on CPU)


def fused_for(head_dim: int, compute_dtype: str, length_split: bool) -> tuple[str, ...]:
  """The fused implementations that run this attention on an NVIDIA GPU. cuDNN's flash
  attention takes head dims up to 128 in multiples of 8, in bf16 or fp16, and cannot split the
  length (XLA partitions it whole); ours takes any of these."""
  cudnn = (head_dim <= 128 and head_dim % 8 == 0 and compute_dtype in ('bfloat16', 'float16')
           and not length_split)
  return FUSED if cudnn else ('pallas',)


def attention(q_BLNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids_BL=None, kv_segment_ids_BS=None,
              implementation: str = 'xla', block_q: int = 0, block_k: int = 0):
  """Scaled dot-product attention with `implementation` in IMPLEMENTATIONS.

  `kv_segment_ids_BS` defaults to `segment_ids_BL` (self-attention over one packed row).
  pallas only: `block_q`, `block_k` (0: the kernel's default for the head_dim). XLA cannot
  partition a Pallas call: under a mesh, run it per shard (sharding.per_shard).
  """
  if segment_ids_BL is not None and kv_segment_ids_BS is None:
    kv_segment_ids_BS = segment_ids_BL
  if implementation == 'xla':
    return xla_attention(q_BLNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BL=segment_ids_BL,
                         kv_segment_ids_BS=kv_segment_ids_BS)
  if implementation == 'cudnn':
    return _cudnn_attention(q_BLNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BL=segment_ids_BL,
                            kv_segment_ids_BS=kv_segment_ids_BS)
  if implementation == 'pallas':
    return flash_attention(q_BLNH, k_BSKH, v_BSKH, causal=causal, segment_ids_BL=segment_ids_BL,
                           kv_segment_ids_BS=kv_segment_ids_BS, block_q=block_q, block_k=block_k)
  raise ValueError(f'attention implementation {implementation!r} is not one of {IMPLEMENTATIONS}')


def xla_attention(q_BLNH, k_BSKH, v_BSKH, *, causal, segment_ids_BL=None, kv_segment_ids_BS=None):
  """The reference: plain einsums and an fp32 softmax, materialising the [L, S] scores."""
  if segment_ids_BL is not None and kv_segment_ids_BS is None:
    kv_segment_ids_BS = segment_ids_BL
  B, L, S = q_BLNH.shape[0], q_BLNH.shape[1], k_BSKH.shape[1]
  return masked_attention(q_BLNH, k_BSKH, v_BSKH,
                          _mask(B, L, S, causal, segment_ids_BL, kv_segment_ids_BS))


def cached_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT):
  """Decoding against a KV cache of S slots: query t of row b, at position positions_BT[b, t],
  attends to the slots 0 … that position (slot s holds position s's key and value)."""
  mask_BTS = positions_BT[:, :, None] >= jnp.arange(k_BSKH.shape[1])[None, None, :]
  return masked_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS)


def masked_attention(q_BLNH, k_BSKH, v_BSKH, mask_BLS):
  """Softmax attention where boolean `mask_BLS` (True = attend; None = all) allows."""
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
  return out_BLKGH.reshape(B, L, N, H).astype(q_BLNH.dtype)


def _mask(B, L, S, causal, segment_ids_BL, kv_segment_ids_BS):
  """Boolean [B, L, S] (True = attend) or None when nothing is masked."""
  mask = None
  if causal:
    # Queries are the last L positions of the S keys (L == S for training).
    q_pos = jnp.arange(L)[:, None] + (S - L)
    mask = jnp.broadcast_to(q_pos >= jnp.arange(S)[None, :], (B, L, S))
  if segment_ids_BL is not None:
    same = segment_ids_BL[:, :, None] == kv_segment_ids_BS[:, None, :]
    mask = same if mask is None else mask & same
  return mask


def _cudnn_attention(q_BLNH, k_BSKH, v_BSKH, *, causal, segment_ids_BL, kv_segment_ids_BS):
  """cuDNN's fused flash attention. It takes no segment ids, so packed rows become a [B,1,L,S]
  boolean mask, which cuDNN applies as a bias: correct, but it materialises L×S per row."""
  mask = None
  if segment_ids_BL is not None:
    mask = (segment_ids_BL[:, :, None] == kv_segment_ids_BS[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BLNH, k_BSKH, v_BSKH, mask=mask, is_causal=causal,
                                      implementation='cudnn')
