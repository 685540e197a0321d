"""Flash attention in Pallas: fused forward and backward, causal or not, grouped-query heads
without copying K/V, packed rows (segment ids), any lengths.

  flash_attention(q[B, L, N, H], k[B, S, K, H], v[B, S, K, H], causal=..., segment_ids=[B, L])
    → o[B, L, N, H]

Forward (grid B × N × L/bq): one query block against the key blocks it can see, online softmax in
fp32 (running max m, sum l, accumulator), writing o and the log-sum-exp lse[B, N, L]. Query head n
reads key/value head n // G through the BlockSpec index map, so K/V are never repeated.
Backward (jax.custom_vjp) recomputes p = exp(s − lse) block by block instead of storing [L, S]:
  dq kernel (grid B × N × L/bq): dq = Σ_j ds_ij k_j · scale, ds = p ⊙ (do·vᵀ − Δ), Δ = rowsum(do ⊙ o)
  dkv kernel (grid B × K × S/bk): for each of the G query heads sharing the kv head and each query
    block: dv += pᵀ do, dk += dsᵀ q · scale; so dk, dv are summed over the group in registers.
Causal is bottom-right aligned (queries are the last L of the S positions), matching the xla
reference, unless `q_offset` (known only at run time, e.g. a device's share of a sequence split)
places query 0 at that key; causal loops stop at the diagonal, so fully masked blocks cost
nothing. A `window` W (a local layer's sliding window: a query sees the W keys ending at its
own) is an input (known at run time, 0: none), and the loops start at the first key block the
window reaches: a query block visits about (W + bq)/bk key blocks, not all those before it.
Lengths are padded up to the block sizes and the padding masked; a row with nothing to
attend to gives zeros (and lse = NEG). `attention_parts` and `attention_parts_grads` expose the
forward with its lse and the backward against a whole row's lse, for attention assembled from
parts (kernels/context_parallel.py).

Lowering, chosen for the platform being compiled for (`jax.lax.platform_dependent`), not for
the devices this process has: Pallas's Triton backend on CUDA (so a step compiled here for GPUs
that are not here, planning/gpu_compiler.py, contains the Triton kernels), interpret mode
elsewhere (CPU tests). Triton rather than Mosaic GPU (JAX's default for pallas_call on GPU): this
block-level body is the one interpret mode runs, so every line the GPU executes is what the CPU
tests check; Mosaic GPU needs a separate warpgroup-level body, and it rejects this one.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

NEG = -1e30  # a finite "minus infinity": exp(NEG - NEG) never makes a NaN
# fp32 operands take twice bf16's shared memory and registers a tile, head dim → tiles by the same
# rule (benchmarks/results/kernel_resources_sweep_fp32-h100-deviceless.json: 64's; every tile
# of that sweep spills at 128 and 256, so theirs are the largest of the smaller ones compiled,
# kernel_resources_fp32_h{128,256}-h100-deviceless.json). At 64, jaxlib 0.12's Triton spills
# 36 bytes a thread in dkv with 2 stages (the sweep's jaxlib 0.10 did not): one stage, the same
# tiles, spills none.
FLOAT32_BLOCKS = {64: (128, 64, 8, 1), 128: (64, 16, 8, 1), 256: (16, 16, 8, 1)}


def default_blocks(head_dim: int, dtype='bfloat16') -> tuple[int, int, int, int]:
  """(block_q, block_k, num_warps, num_stages) for head_dim and q, k, v's dtype: the largest
  tiles with which none of the three kernels spills registers or passes the shared memory of
  Hopper (benchmarks/kernel_resources.py --sweep shows how they were chosen). num_warps and
  num_stages are Triton's; interpret mode uses only the tiles."""
  if jnp.dtype(dtype).itemsize > 2:
    return FLOAT32_BLOCKS[min((h for h in FLOAT32_BLOCKS if h >= head_dim), default=256)]
  if head_dim <= 64:
    return 128, 128, 8, 3
  if head_dim <= 128:
    return 128, 64, 8, 2
  return 128, 32, 8, 2


def hopper_blocks(head_dim: int) -> tuple[int, int]:
  """(block_q, block_k) of the Hopper kernels (kernels/flash_attention_hopper.py): one consumer
  warpgroup's 64 query rows; 128 keys a step (FlashAttention-3's tile) up to head dim 128, 64
  above, where two stages of K and V at 128 would pass the 227 KiB of shared memory."""
  return 64, 128 if head_dim <= 128 else 64


def pallas_for_platform(kernel, args, *, interpret, num_warps, num_stages, **call):
  """pl.pallas_call(kernel, **call)(*args), lowered with Triton when compiled for CUDA and in
  interpret mode for any other platform (or everywhere when `interpret` is True)."""
  def lowered_for(gpu: bool):
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages) if gpu else None
    return pl.pallas_call(kernel, interpret=not gpu, compiler_params=params, **call)
  if interpret is not None:
    return lowered_for(not interpret)(*args)
  return jax.lax.platform_dependent(*args, cuda=lowered_for(True), default=lowered_for(False))


def _block(size: int, requested: int) -> int:
  """The block for a dimension: `requested`, or for a short one the next power of two ≥ 16."""
  return min(requested, max(16, 1 << (size - 1).bit_length()))


WIDE = 1 << 30  # a window no row reaches: "no window"


# A window's work as our kernel does it, at most this × the keys its queries see: a query block of
# bq rows reaches back over the window's keys and its own, in whole key blocks, so for a window
# its tiles are cut (windowed_blocks) until the blocks it visits are within this
WINDOW_WASTE = 1.15


def windowed_blocks(window: int, block_q: int, block_k: int,
                    smallest: int = 16) -> tuple[int, int]:
  """(block_q, block_k) for a window: the tiles halved, the larger first, down to `smallest`
  (the Hopper kernel's wgmma tiles are 64), until a query block visits at most WINDOW_WASTE ×
  `window` keys a row (window + block_q − 1 keys, and a key block's more for where they fall)."""
  while (max(block_q, block_k) > smallest
         and window + block_q - 1 + block_k > WINDOW_WASTE * window):
    if block_q >= block_k:
      block_q //= 2
    else:
      block_k //= 2
  return block_q, block_k


def keys_seen(length: int, window: int = 0) -> float:
  """The keys a query of a causal row of `length` sees on average: half the row (the convention
  of FLOP counts), or within a `window` shorter than the row, W − W(W − 1)/(2·length)."""
  if window and window < length:
    return window - window * (window - 1) / (2 * length)
  return length / 2


def _mask(q_pos, k_idx, *, causal, kv_len, q_seg=None, k_seg=None, window=None):
  """[bq, bk] True where a query at key index q_pos may attend to key k_idx (within `window`
  keys ending at its own, where given)."""
  mask = k_idx[None, :] < kv_len
  if causal:
    mask &= q_pos[:, None] >= k_idx[None, :]
  if window is not None:
    mask &= q_pos[:, None] - k_idx[None, :] < window
  if q_seg is not None:
    mask &= q_seg[:, None] == k_seg[None, :]
  return mask


def _kv_blocks_to_visit(last_q, *, causal, bk, n_kv):
  """Key blocks that a query block whose last query sits at key index last_q can see: all, or
  up to its diagonal."""
  if not causal:
    return n_kv
  return jnp.clip(last_q // bk + 1, 0, n_kv)


def _first_kv_block(first_q, window, *, bk, n_kv):
  """The first key block a query block whose first query sits at key index first_q reaches
  within `window` (0 without one)."""
  if window is None:
    return jnp.int32(0)
  return jnp.clip((first_q - window + 1) // bk, 0, n_kv)


def _query_blocks_reaching(j, window, *, causal, offset, bq, bk, n_q):
  """(first, end): the query blocks that see key block j: from the first that can (causal,
  else 0) to past the last whose queries reach it within `window` (all without one)."""
  first = jnp.clip((j * bk - offset) // bq, 0, n_q) if causal else jnp.int32(0)
  if window is None:
    return first, n_q
  return first, jnp.clip(((j + 1) * bk - 1 + window - 1 - offset) // bq + 1, first, n_q)


def _read_window(window_ref):
  """The window an input holds, WIDE for 0 (none); None without the input."""
  if window_ref is None:
    return None
  window = window_ref[0]
  return jnp.where(window > 0, window, WIDE)


def _split_refs(refs, segments, positions, n_in, windowed=False):
  """(inputs, segment refs or Nones, query-position ref or None, window ref or None, outputs) of
  a kernel's refs: the n_in plain inputs, then [q_seg, kv_seg] with segments, then [q_pos] with
  positions, then [window] when windowed."""
  refs = list(refs)
  ins, rest = refs[:n_in], refs[n_in:]
  segs = (rest.pop(0), rest.pop(0)) if segments else (None, None)
  qpos = rest.pop(0) if positions else None
  window = rest.pop(0) if windowed else None
  return ins, segs, qpos, window, rest


def _query_positions(qpos_ref, i, bq, offset):
  """(key indices of query block i, the last of them): read from q_pos when given (an offset
  known only at run time), else i·bq + offset (causal attention is bottom-right aligned)."""
  if qpos_ref is not None:
    q_pos = qpos_ref[...]
    return q_pos, q_pos.max()
  return i * bq + jnp.arange(bq) + offset, (i + 1) * bq - 1 + offset


def _fwd_kernel(*refs, causal, scale, offset, kv_len, bq, bk, n_kv, segments, positions,
                windowed):
  (q_ref, k_ref, v_ref), (qs_ref, ks_ref), qp_ref, w_ref, (o_ref, lse_ref) = _split_refs(
      refs, segments, positions, 3, windowed)
  i = pl.program_id(2)
  q = q_ref[...]
  q_pos, last_q = _query_positions(qp_ref, i, bq, offset)
  q_seg = qs_ref[...] if segments else None
  window = _read_window(w_ref)

  def body(j, carry):
    m, l, acc = carry
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    k_seg = ks_ref[pl.ds(j * bk, bk)] if segments else None
    mask = _mask(q_pos, j * bk + jnp.arange(bk), causal=causal, kv_len=kv_len, q_seg=q_seg,
                 k_seg=k_seg, window=window)
    s = jnp.where(mask, s, NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l * alpha + p.sum(axis=1), acc

  H = q.shape[-1]
  init = (jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, H), jnp.float32))
  upper = _kv_blocks_to_visit(last_q, causal=causal, bk=bk, n_kv=n_kv)
  lower = _first_kv_block(q_pos.min(), window, bk=bk, n_kv=n_kv)
  m, l, acc = jax.lax.fori_loop(lower, upper, body, init)
  # A row that may attend to nothing (padding, or no key of its document in this block of keys)
  # gives zeros and lse = NEG: the weight exp(lse − lse_total) it gets when partial results are
  # merged (kernels/context_parallel.py) is then 0.
  seen = l > 0
  o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None],
                         0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG)


def _dq_kernel(*refs, causal, scale, offset, kv_len, bq, bk, n_kv, segments, positions,
               windowed):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qs_ref, ks_ref), qp_ref, w_ref, (dq_ref,) = \
      _split_refs(refs, segments, positions, 6, windowed)
  i = pl.program_id(2)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_pos, last_q = _query_positions(qp_ref, i, bq, offset)
  q_seg = qs_ref[...] if segments else None
  window = _read_window(w_ref)

  def body(j, dq):
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    k_seg = ks_ref[pl.ds(j * bk, bk)] if segments else None
    mask = _mask(q_pos, j * bk + jnp.arange(bk), causal=causal, kv_len=kv_len, q_seg=q_seg,
                 k_seg=k_seg, window=window)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  upper = _kv_blocks_to_visit(last_q, causal=causal, bk=bk, n_kv=n_kv)
  lower = _first_kv_block(q_pos.min(), window, bk=bk, n_kv=n_kv)
  dq = jax.lax.fori_loop(lower, upper, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, causal, scale, offset, kv_len, bq, bk, n_q, group, segments, positions,
                windowed):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qs_ref, ks_ref), qp_ref, w_ref, \
      (dk_ref, dv_ref) = _split_refs(refs, segments, positions, 6, windowed)
  window = _read_window(w_ref)
  b, kv_head, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  k_idx = j * bk + jnp.arange(bk)
  k_seg = ks_ref[...] if segments else None
  if positions:  # query positions are contiguous: the first block's least is the offset
    offset = qp_ref[pl.ds(0, bq)].min()
  first, end = _query_blocks_reaching(j, window, causal=causal, offset=offset, bq=bq, bk=bk,
                                      n_q=n_q)
  per_head = end - first  # query blocks each head contributes

  def body(t, carry):
    dk, dv = carry
    # lax's truncating div and rem (t, per_head ≥ 0): Triton's lowering of jnp's flooring ones
    # fails for a divisor known at trace time.
    g, i = jax.lax.div(t, per_head), first + jax.lax.rem(t, per_head)
    head = kv_head * group + g
    rows = pl.ds(i * bq, bq)
    q = q_ref[b, rows, head, :]
    do = do_ref[b, rows, head, :]
    lse = lse_ref[b, head, rows]
    delta = delta_ref[b, head, rows]
    q_seg = qs_ref[b, rows] if segments else None
    mask = _mask(i * bq + jnp.arange(bq) + offset, k_idx, causal=causal, kv_len=kv_len,
                 q_seg=q_seg, k_seg=k_seg, window=window)
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    dv = dv + jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    dk = dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return dk, dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, group * per_head, body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _pad(x, axis, to):
  if x is None or x.shape[axis] == to:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, to - x.shape[axis])
  return jnp.pad(x, widths)


class _Static(NamedTuple):
  """What a kernel launch is specialised on (hashable: custom_vjp's non-differentiable arg)."""
  causal: bool
  bq: int
  bk: int
  L: int  # unpadded query and key lengths
  S: int
  interpret: bool | None
  num_warps: int
  num_stages: int
  out_dtype: str | None = None  # o, dq, dk, dv in this dtype; None: their inputs' dtypes
  hopper: bool = False  # forward and backward by kernels/flash_attention_hopper.py (sm_90a)
  windowed: bool = False  # a window is an input (its value known at run time)
  work: float = 1.0  # with a window: the share of causal attention's work it leaves, on average

  def kernel_args(self, H):
    return dict(causal=self.causal, scale=1 / math.sqrt(H), offset=self.S - self.L,
                kv_len=self.S, bq=self.bq, bk=self.bk, windowed=self.windowed)

  def launch(self):
    return dict(interpret=self.interpret, num_warps=self.num_warps, num_stages=self.num_stages)

  def dtype(self, x):
    return jnp.dtype(self.out_dtype) if self.out_dtype else x.dtype

  def scope(self):
    """Names a launch by its mask in the program's metadata, where the time model reads it
    (planning/timing.py): a causal kernel skips the blocks past the diagonal."""
    return jax.named_scope(f'windowed_{round(1000 * self.work):04d}' if self.windowed else
                           'causal' if self.causal else 'unmasked')


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, q_seg, kv_seg, q_pos, window, static):
  return _forward(q, k, v, q_seg, kv_seg, q_pos, window, static)[0]


def _forward(q, k, v, q_seg, kv_seg, q_pos, window, st: _Static):
  """On padded inputs: o[B, Lp, N, H] and the residuals, lse[B, N, Lp] last."""
  B, Lp, N, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  G, bq, bk = N // K, st.bq, st.bk
  segments, positions = q_seg is not None, q_pos is not None
  kernel = functools.partial(_fwd_kernel, **st.kernel_args(H), n_kv=Sp // bk, segments=segments,
                             positions=positions)
  sq = pl.squeezed
  in_specs = [pl.BlockSpec((sq, bq, sq, H), lambda b, n, i: (b, i, n, 0)),
              pl.BlockSpec((sq, Sp, sq, H), lambda b, n, i: (b, 0, n // G, 0)),
              pl.BlockSpec((sq, Sp, sq, H), lambda b, n, i: (b, 0, n // G, 0))]
  args = [q, k, v]
  if segments:
    in_specs += [pl.BlockSpec((sq, bq), lambda b, n, i: (b, i)),
                 pl.BlockSpec((sq, Sp), lambda b, n, i: (b, 0))]
    args += [q_seg, kv_seg]
  if positions:
    in_specs.append(pl.BlockSpec((bq,), lambda b, n, i: (i,)))
    args.append(q_pos)
  if st.windowed:
    in_specs.append(pl.BlockSpec((1,), lambda b, n, i: (0,)))
    args.append(window)
  if st.hopper:  # the same o and lse from the Hopper kernel
    if (Lp, Sp) != (st.L, st.S):
      raise ValueError(f'flash_attention(hopper=True): L={st.L} and S={st.S} must be multiples '
                       f'of block_q={bq} and block_k={bk} (the Hopper kernel masks no padding)')
    # Imported here: Mosaic GPU's Pallas adds some 0.3 s to every process that imports this file.
    from kernels import flash_attention_hopper  # pylint: disable=import-outside-toplevel
    with st.scope():
      o, lse = flash_attention_hopper.forward(
          q, k, v, q_seg, kv_seg, causal=st.causal, scale=1 / math.sqrt(H),
          q_offset=q_pos[0] if positions else None, window=window, out_dtype=st.out_dtype,
          block_q=bq, block_k=bk, interpret=st.interpret)
  else:
    with st.scope():
      o, lse = pallas_for_platform(
          kernel, args, grid=(B, N, Lp // bq), in_specs=in_specs,
          out_specs=[pl.BlockSpec((sq, bq, sq, H), lambda b, n, i: (b, i, n, 0)),
                     pl.BlockSpec((sq, sq, bq), lambda b, n, i: (b, n, i))],
          out_shape=[jax.ShapeDtypeStruct(q.shape, st.dtype(q)),
                     jax.ShapeDtypeStruct((B, N, Lp), jnp.float32)],
          name='flash_attention_fwd', **st.launch())
  # the remat policies that keep attention (model/transformer.py) save these two by this name
  o, lse = checkpoint_name(o, 'attention_kernel'), checkpoint_name(lse, 'attention_kernel')
  return o, (q, k, v, q_seg, kv_seg, q_pos, window, o, lse)


def _backward(st: _Static, residuals, do, delta=None):
  """(dq, dk, dv, None, None, None, None) on padded inputs. p = exp(s − lse) with the lse given,
  so with the lse of a whole row (over keys this call does not see) these are that row's
  gradients' shares from these keys. delta = rowsum(do ⊙ o) of the whole output likewise."""
  q, k, v, q_seg, kv_seg, q_pos, window, o, lse = residuals
  B, Lp, N, H = q.shape
  Sp, K = k.shape[1], k.shape[2]
  G, bq, bk = N // K, st.bq, st.bk
  segments, positions = q_seg is not None, q_pos is not None
  if delta is None:
    delta = jnp.einsum('blnh,blnh->bnl', o.astype(jnp.float32), do.astype(jnp.float32))
  if st.hopper:  # the Hopper kernels: the same gradients from the same residuals
    from kernels import flash_attention_hopper  # pylint: disable=import-outside-toplevel
    with st.scope():
      dq, dk, dv = flash_attention_hopper.backward(
          q, k, v, do.astype(q.dtype), lse, delta, q_seg, kv_seg, causal=st.causal,
          scale=1 / math.sqrt(H), q_offset=q_pos[0] if positions else None, window=window,
          out_dtype=st.out_dtype, interpret=st.interpret)
    return dq, dk, dv, None, None, None, None
  common = dict(**st.kernel_args(H), segments=segments, positions=positions)
  sq = pl.squeezed
  extra = (([q_seg, kv_seg] if segments else []) + ([q_pos] if positions else [])
           + ([window] if st.windowed else []))

  dq_specs = [pl.BlockSpec((sq, bq, sq, H), lambda b, n, i: (b, i, n, 0)),
              pl.BlockSpec((sq, Sp, sq, H), lambda b, n, i: (b, 0, n // G, 0)),
              pl.BlockSpec((sq, Sp, sq, H), lambda b, n, i: (b, 0, n // G, 0)),
              pl.BlockSpec((sq, bq, sq, H), lambda b, n, i: (b, i, n, 0)),
              pl.BlockSpec((sq, sq, bq), lambda b, n, i: (b, n, i)),
              pl.BlockSpec((sq, sq, bq), lambda b, n, i: (b, n, i))]
  if segments:
    dq_specs += [pl.BlockSpec((sq, bq), lambda b, n, i: (b, i)),
                 pl.BlockSpec((sq, Sp), lambda b, n, i: (b, 0))]
  if positions:
    dq_specs.append(pl.BlockSpec((bq,), lambda b, n, i: (i,)))
  if st.windowed:
    dq_specs.append(pl.BlockSpec((1,), lambda b, n, i: (0,)))
  with st.scope():
    dq = pallas_for_platform(
        functools.partial(_dq_kernel, n_kv=Sp // bk, **common), [q, k, v, do, lse, delta, *extra],
        grid=(B, N, Lp // bq), in_specs=dq_specs,
        out_specs=pl.BlockSpec((sq, bq, sq, H), lambda b, n, i: (b, i, n, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, st.dtype(q)), name='flash_attention_dq',
        **st.launch())

  # q, do, lse, delta and the query segment ids and positions are read whole and indexed in the
  # kernel: one program walks all G query heads of its kv head.
  whole = pl.BlockSpec()  # no block shape: the kernel sees the whole array
  dkv_specs = [whole,
               pl.BlockSpec((sq, bk, sq, H), lambda b, h, j: (b, j, h, 0)),
               pl.BlockSpec((sq, bk, sq, H), lambda b, h, j: (b, j, h, 0)),
               whole, whole, whole]
  if segments:
    dkv_specs += [whole, pl.BlockSpec((sq, bk), lambda b, h, j: (b, j))]
  if positions:
    dkv_specs.append(whole)
  if st.windowed:
    dkv_specs.append(pl.BlockSpec((1,), lambda b, h, j: (0,)))
  with st.scope():
    dk, dv = pallas_for_platform(
        functools.partial(_dkv_kernel, n_q=Lp // bq, group=G, **common),
        [q, k, v, do, lse, delta, *extra], grid=(B, K, Sp // bk), in_specs=dkv_specs,
        out_specs=[pl.BlockSpec((sq, bk, sq, H), lambda b, h, j: (b, j, h, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct(k.shape, st.dtype(k)),
                   jax.ShapeDtypeStruct(v.shape, st.dtype(v))],
        name='flash_attention_dkv', **st.launch())
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash_lse(q, k, v, q_seg, kv_seg, q_pos, window, static):
  """_flash's o and its lse[B, N, Lp], a statistic without a gradient (QK-clip's)."""
  o, residuals = _forward(q, k, v, q_seg, kv_seg, q_pos, window, static)
  return o, residuals[-1]


def _forward_lse(q, k, v, q_seg, kv_seg, q_pos, window, static):
  o, residuals = _forward(q, k, v, q_seg, kv_seg, q_pos, window, static)
  return (o, residuals[-1]), residuals


def _backward_lse(static, residuals, cotangents):
  return _backward(static, residuals, cotangents[0])


_flash_lse.defvjp(_forward_lse, _backward_lse)


def _prepare(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, kv_segment_ids_BS, q_offset, *, causal,
             block_q, block_k, num_warps, num_stages, interpret, out_dtype=None, hopper=False,
             window=None, window_mix=None):
  """Checks, defaults, padding to whole blocks: (q, k, v, q_seg, kv_seg, q_pos, window,
  static)."""
  if window is not None and not causal:
    raise ValueError("flash_attention: a window is for causal attention (a local layer's)")
  B, L, N, H = q_BLNH.shape
  defaults = default_blocks(H, q_BLNH.dtype)
  if hopper:  # one consumer warpgroup's 64 rows; its own key tile
    defaults = (*hopper_blocks(H), *defaults[2:])
    block_q = 64
  size = window if isinstance(window, int) else (window_mix or (0,))[0]
  if size:  # a window's own tiles, where none are asked for
    windowed = windowed_blocks(size, block_q or defaults[0], block_k or defaults[1],
                               smallest=64 if hopper else 16)
    block_q, block_k = block_q or windowed[0], block_k or windowed[1]
  block_q, block_k = block_q or defaults[0], block_k or defaults[1]
  num_warps, num_stages = num_warps or defaults[2], num_stages or defaults[3]
  S, K = k_BSKH.shape[1], k_BSKH.shape[2]
  if N % K or k_BSKH.shape != v_BSKH.shape or k_BSKH.shape[0] != B or k_BSKH.shape[3] != H:
    raise ValueError(f'flash_attention: q {q_BLNH.shape} and k, v {k_BSKH.shape}, '
                     f'{v_BSKH.shape} must be [B, L, N, H] and [B, S, K, H] with N % K == 0')
  if segment_ids_BL is not None and kv_segment_ids_BS is None:
    kv_segment_ids_BS = segment_ids_BL
  bq, bk = _block(L, block_q), _block(S, block_k)
  Lp, Sp = -(-L // bq) * bq, -(-S // bk) * bk
  q, k, v = _pad(q_BLNH, 1, Lp), _pad(k_BSKH, 1, Sp), _pad(v_BSKH, 1, Sp)
  q_seg = kv_seg = q_pos = None
  if segment_ids_BL is not None:
    q_seg = _pad(segment_ids_BL.astype(jnp.int32), 1, Lp)
    kv_seg = _pad(kv_segment_ids_BS.astype(jnp.int32), 1, Sp)
  if q_offset is not None:
    q_pos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(Lp, dtype=jnp.int32)
  # What a window leaves of the causal work, as the time model charges it: a window fixed here;
  # one known at run time, as `window_mix` (its value where local, the share of runs local) says
  size, local = (window, 1.0) if isinstance(window, int) else window_mix or (0, 0.0)
  work = local * keys_seen(S, size) / keys_seen(S) + 1 - local
  static = _Static(causal, bq, bk, L, S, interpret, num_warps, num_stages, out_dtype, hopper,
                   window is not None, work)
  if window is not None:
    window = jnp.asarray(window, jnp.int32).reshape(1)
  return q, k, v, q_seg, kv_seg, q_pos, window, static


def flash_attention(q_BLNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids_BL=None,
                    kv_segment_ids_BS=None, q_offset=None, block_q: int = 0, block_k: int = 0,
                    num_warps: int = 0, num_stages: int = 0, interpret: bool | None = None,
                    hopper: bool = False, window=None, window_mix: tuple | None = None,
                    with_lse: bool = False):
  """Fused attention with the layout of jax.nn.dot_product_attention (see the module docstring);
  with `with_lse`, (o, lse[B, N, L]): each query's log-sum-exp of its scaled scores, without a
  gradient (NEG where it sees no key).

  window: causal only, the keys a query sees ending at its own (an int, or an int32 scalar
  known at run time; 0: all), as kernels/attention.py's; window_mix, for one known at run time:
  (its value where it is not 0, the share of calls it is not), which the time model charges.
  q_offset: causal only, the key index of query 0 (a traced int32 is fine, e.g. this device's
  share of a sequence split); None: S − L (bottom-right aligned).
  block_q, block_k: query and key rows per program (powers of two; shorter inputs use less).
  num_warps, num_stages: Triton launch settings on GPU. 0 takes default_blocks(head_dim).
  interpret: None (default) lowers with Triton for CUDA and in interpret mode for any other
  platform; True interprets everywhere, False uses Triton everywhere.
  hopper: forward and backward by our Hopper kernels (kernels/flash_attention_hopper.py: Mosaic
  GPU's warp-specialised TMA + wgmma, 64 query rows a block, L and S in whole blocks); their
  interpret: None runs Mosaic GPU's interpreter unless traced for a GPU (the platform of the
  mesh in use, else the default backend), False lowers for sm_90a.
  """
  *args, static = _prepare(q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, kv_segment_ids_BS, q_offset,
                           causal=causal, block_q=block_q, block_k=block_k,
                           num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                           hopper=hopper, window=window, window_mix=window_mix)
  L = q_BLNH.shape[1]
  if with_lse:
    o, lse = _flash_lse(*args, static)
    return o[:, :L], jax.lax.stop_gradient(lse[:, :, :L])
  return _flash(*args, static)[:, :L]


def attention_parts(q_BLNH, k_BSKH, v_BSKH, *, causal: bool, segment_ids_BL=None,
                    kv_segment_ids_BS=None, block_q: int = 0, block_k: int = 0,
                    interpret: bool | None = None, hopper: bool = False, q_offset=None,
                    window=None, window_mix: tuple | None = None):
  """The forward kernel's o[B, L, N, H] in fp32 and lse[B, N, L] (NEG where a query sees no key):
  one part of an attention over more keys, to be merged with the others by their lse. hopper,
  q_offset, window, window_mix: flash_attention's."""
  q, k, v, q_seg, kv_seg, q_pos, window, st = _prepare(
      q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, kv_segment_ids_BS, q_offset, causal=causal,
      block_q=block_q, block_k=block_k, num_warps=0, num_stages=0, interpret=interpret,
      out_dtype='float32', hopper=hopper, window=window, window_mix=window_mix)
  o, residuals = _forward(q, k, v, q_seg, kv_seg, q_pos, window, st)
  L = q_BLNH.shape[1]
  return o[:, :L], residuals[-1][:, :, :L]


def attention_parts_grads(q_BLNH, k_BSKH, v_BSKH, o_BLNH, lse_BNL, do_BLNH, delta_BNL, *,
                          causal: bool, segment_ids_BL=None, kv_segment_ids_BS=None,
                          block_q: int = 0, block_k: int = 0, interpret: bool | None = None,
                          hopper: bool = False, q_offset=None, window=None,
                          window_mix: tuple | None = None):
  """The backward kernels for one part (attention_parts) of an attention whose whole output o,
  lse and delta = rowsum(do ⊙ o) are given: this part's dq and its keys' dk, dv, in fp32."""
  q, k, v, q_seg, kv_seg, q_pos, window, st = _prepare(
      q_BLNH, k_BSKH, v_BSKH, segment_ids_BL, kv_segment_ids_BS, q_offset, causal=causal,
      block_q=block_q, block_k=block_k, num_warps=0, num_stages=0, interpret=interpret,
      out_dtype='float32', hopper=hopper, window=window, window_mix=window_mix)
  Lp, L, S = q.shape[1], q_BLNH.shape[1], k_BSKH.shape[1]
  # Padded query rows: do = 0 and lse = 0 make their p finite and their ds, dv shares 0.
  residuals = (q, k, v, q_seg, kv_seg, q_pos, window, _pad(o_BLNH, 1, Lp), _pad(lse_BNL, 2, Lp))
  dq, dk, dv, *_ = _backward(st, residuals, _pad(do_BLNH, 1, Lp), _pad(delta_BNL, 2, Lp))
  return dq[:, :L], dk[:, :S], dv[:, :S]
