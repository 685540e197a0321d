"""Flash attention's forward for Hopper (sm_90a) in Pallas's Mosaic GPU backend: the first step of
our own FlashAttention-3-class kernel (issue 51), beside kernels/flash_attention.py (Triton).

  forward(q[B, L, N, H], k[B, S, K, H], v[B, S, K, H], q_seg[B, L], kv_seg[B, S], causal, scale)
    → o[B, L, N, H], lse[B, N, L]

the same outputs, semantics and residuals as kernels/flash_attention.py's forward: causal is
bottom-right aligned (queries are the last L of the S positions), query head n reads key/value
head n // G (grouped-query heads, K/V never repeated), segment ids mask across packed documents,
and a row with nothing to attend to gives zeros and lse = NEG. So its (o, lse) feed that file's
backward kernels unchanged.

What Hopper adds, and where it is used here:
- warp specialisation: each block (grid L/bq × N × B) runs two warpgroups. The producer only
  issues TMA copies (the tensor memory accelerator: asynchronous tile loads, global → shared),
  the consumer only computes, so the loads of key block j+1.. run under the work on block j;
- a ring of `stages` shared-memory slots for K, V (and the key segment ids), each with a barrier
  the TMA completes ("loaded") and one the consumer arrives at when done with it ("consumed"), so
  the producer refills a slot the moment it is free;
- wgmma: both matmuls on the tensor cores straight from shared memory (S = Q·Kᵀ with Kᵀ a
  transposed view of the slot, no copy; P·V with P staged in shared memory), fp32 accumulators.
  P goes through shared memory because the interpreter's wgmma takes both operands from there,
  and the CPU tests must run the very body the GPU runs; P from registers (FlashAttention-3's
  choice) is a variant for a GPU to measure;
- the online softmax in the log2 domain (one multiply folds in scale·log2 e, then exp2), and
  causal blocks split in two loops: the blocks wholly below the diagonal take no mask at all.

Shapes: L a multiple of block_q, S of block_k (kernels/flash_attention.py pads before its
kernels), H a multiple of 64 up to 256, bf16 or fp16 in, fp32 inside. On CPU it runs in Mosaic
GPU's interpret mode, which simulates the warpgroups, shared memory, the TMA and the barriers
(the CPU tests); on CUDA it lowers for the GPU (sm_90a: wgmma and the TMA are Hopper's).
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

NEG = -1e30  # as kernels/flash_attention.py: a finite "minus infinity", never a NaN
LOG2E, LN2 = math.log2(math.e), math.log(2)
SWIZZLE = 128  # bytes: wgmma reads shared memory tiles of 8 rows × 128 bytes, swizzled


def check(q_BLNH, k_BSKH, v_BSKH, *, block_q: int, block_k: int, stages: int) -> None:
  """Raises ValueError, naming what to change, for what this kernel does not take."""
  (B, L, N, H), (_, S, K, _) = q_BLNH.shape, k_BSKH.shape
  if k_BSKH.shape != v_BSKH.shape or k_BSKH.shape[0] != B or k_BSKH.shape[3] != H:
    raise ValueError(f'k {k_BSKH.shape} and v {v_BSKH.shape} must be [B, S, K, H] of q '
                     f'{q_BLNH.shape}')
  if N % K:
    raise ValueError(f'{N} query heads do not share {K} key/value heads evenly')
  if H % 64 or H > 256:
    raise ValueError(f'head_dim={H}: the Hopper kernel takes multiples of 64 up to 256')
  if jnp.dtype(q_BLNH.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f'{q_BLNH.dtype} inputs: the Hopper kernel takes bfloat16 or float16 '
                     '(wgmma); use the Triton kernel for float32')
  if block_q != 64:  # one warpgroup's wgmma rows
    raise ValueError(f'block_q={block_q}: the consumer warpgroup takes 64 query rows')
  if block_k % 64 or not 64 <= block_k <= 256:
    raise ValueError(f'block_k={block_k}: a multiple of 64 up to 256')
  if L % block_q or S % block_k:
    raise ValueError(f'L={L}, S={S}: pad them to multiples of block_q={block_q} and '
                     f'block_k={block_k}')
  if stages < 1:
    raise ValueError(f'stages={stages}: at least one shared-memory slot')
  size = q_BLNH.dtype.itemsize
  smem = (block_q * H * size + 2 * stages * block_k * H * size + block_q * block_k * size
          + 4 * (block_q + stages * block_k + block_q))
  if smem > 227 * 1024:
    raise ValueError(f'block_k={block_k}, stages={stages} at head_dim={H} need {smem} bytes of '
                     'shared memory, over the H100\'s 227 KiB: fewer stages or a smaller block_k')


def forward(q_BLNH, k_BSKH, v_BSKH, q_seg_BL=None, kv_seg_BS=None, *, causal: bool, scale: float,
            block_q: int = 64, block_k: int = 128, stages: int = 2, interpret: bool | None = None):
  """(o[B, L, N, H], lse[B, N, L]): see the module docstring. Segment ids both or neither.

  interpret: run Mosaic GPU's interpreter (True) or lower for the GPU (False); None picks by
  the default backend. Not chosen per platform at lowering (`lax.platform_dependent`), as the
  Triton kernel is: the interpreter's callbacks are effects a platform-dependent branch cannot
  carry, so a process compiling for GPUs that are not here (planning/gpu_compiler.py) says False."""
  check(q_BLNH, k_BSKH, v_BSKH, block_q=block_q, block_k=block_k, stages=stages)
  if (q_seg_BL is None) != (kv_seg_BS is None):
    raise ValueError('give both segment id arrays (query and key) or neither')
  segments = q_seg_BL is not None
  (B, L, N, H), (_, S, K, _) = q_BLNH.shape, k_BSKH.shape
  group, n_kv, offset = N // K, S // block_k, S - L
  dtype = q_BLNH.dtype
  tiles = (plgpu.TilingTransform((8, SWIZZLE // dtype.itemsize)), plgpu.SwizzleTransform(SWIZZLE))

  def kernel(*refs):
    if segments:
      q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, *scratch = refs
    else:
      (q_ref, k_ref, v_ref, o_ref, lse_ref, *scratch), qs_ref, ks_ref = refs, None, None
    q_smem, k_smem, v_smem, p_smem, qs_smem, ks_smem, lse_smem, *barriers = scratch
    q_bar, k_bar, v_bar, consumed = barriers
    i, head, b = lax.axis_index('q'), lax.axis_index('head'), lax.axis_index('batch')
    first_row = i * block_q
    # Key blocks this query block sees: all, or (causal) up to the one holding its last row's
    # diagonal; below `full` no key is past any row's diagonal, so those blocks need no mask.
    if causal:
      steps = jnp.clip(pl.cdiv(first_row + block_q + offset, block_k), 0, n_kv)
      full = jnp.clip((first_row + offset + 1) // block_k, 0, steps)
    else:
      steps = full = jnp.int32(n_kv)

    @pl.when(lax.axis_index('wg') == 1)
    def _producer():
      kv_head = head // group

      @pl.loop(0, steps)
      def _(step):
        slot = lax.rem(step, stages)

        @pl.when(step >= stages)
        def _():  # the consumer is done with what this slot held
          plgpu.barrier_wait(consumed.at[slot])
        keys = pl.ds(step * block_k, block_k)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv_head], k_smem.at[slot], k_bar.at[slot])
        if segments:
          plgpu.copy_gmem_to_smem(ks_ref.at[b, keys], ks_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv_head], v_smem.at[slot], v_bar.at[slot])

    @pl.when(lax.axis_index('wg') == 0)
    def _consumer():
      rows = pl.ds(first_row, block_q)
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], q_smem, q_bar)
      if segments:
        plgpu.copy_gmem_to_smem(qs_ref.at[b, rows], qs_smem, q_bar)
      plgpu.barrier_wait(q_bar)
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      q_seg = plgpu.load(qs_smem, layout=row_layout) if segments else None
      m = plgpu.layout_cast(jnp.full((block_q,), NEG, jnp.float32), row_layout)
      l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout)
      acc = plgpu.layout_cast(jnp.zeros((block_q, H), jnp.float32), plgpu.Layout.WGMMA)

      def attend(step, carry, diagonal: bool):
        acc, m, l = carry
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(k_bar.at[slot])

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((block_q, block_k), jnp.float32)) * (scale * LOG2E)
        visible = None
        if diagonal:  # key c is seen by query row r when c ≤ r + offset
          r = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
          c = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
          visible = c + step * block_k <= r + (first_row + offset)
        if segments:
          k_seg = plgpu.load(ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          same = (lax.broadcast_in_dim(q_seg, s.shape, [0])
                  == lax.broadcast_in_dim(k_seg, s.shape, [1]))
          visible = same if visible is None else visible & same
        if visible is not None:
          s = jnp.where(visible, s, NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        if visible is not None:  # a row that sees nothing here keeps p = 0, not exp2(0)
          p = jnp.where(visible, p, 0.0)
        l = l * alpha + p.sum(axis=1)
        plgpu.barrier_wait(v_bar.at[slot])

        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()  # written by the threads, read by the tensor cores

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
          return acc_ref[...]
        o = pl.run_scoped(pv, plgpu.ACC((block_q, H), jnp.float32))
        plgpu.barrier_arrive(consumed.at[slot])  # K, V and key ids of this slot are read
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o, m_new, l

      carry = lax.fori_loop(0, full, lambda j, c: attend(j, c, diagonal=False), (acc, m, l))
      acc, m, l = lax.fori_loop(full, steps, lambda j, c: attend(j, c, diagonal=True), carry)
      seen = l > 0.0
      acc = acc / lax.broadcast_in_dim(jnp.where(seen, l, 1.0), acc.shape, [0])
      q_smem[...] = acc.astype(dtype)  # Q is no longer read: its slot stages the output
      lse_smem[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, NEG)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, rows, head])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, head, rows])
      plgpu.wait_smem_to_gmem(0)

  loads = 2 if segments else 1  # TMA copies completing each of q_bar and k_bar[slot]
  scratch = [
      plgpu.SMEM((block_q, H), dtype, transforms=tiles),
      plgpu.SMEM((stages, block_k, H), dtype, transforms=tiles),
      plgpu.SMEM((stages, block_k, H), dtype, transforms=tiles),
      plgpu.SMEM((block_q, block_k), dtype, transforms=tiles),
      plgpu.SMEM((block_q,), jnp.int32), plgpu.SMEM((stages, block_k), jnp.int32),
      plgpu.SMEM((block_q,), jnp.float32),
      plgpu.Barrier(num_arrivals=loads), plgpu.Barrier(num_arrivals=loads, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)]
  out_type = (jax.ShapeDtypeStruct((B, L, N, H), dtype),
              jax.ShapeDtypeStruct((B, N, L), jnp.float32))
  args = (q_BLNH, k_BSKH, v_BSKH) + ((q_seg_BL.astype(jnp.int32), kv_seg_BS.astype(jnp.int32))
                                     if segments else ())

  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch,
                      grid=(L // block_q, N, B), grid_names=('q', 'head', 'batch'),
                      num_threads=2, thread_name='wg',
                      interpret=plgpu.InterpretGPUParams() if interpret else None,
                      compiler_params=plgpu.CompilerParams(approx_math=True))(*args)
