"""Flash attention for Hopper (sm_90a) in Pallas's Mosaic GPU backend, forward and backward: our
own FlashAttention-3-class kernels in the making, beside kernels/flash_attention.py (Triton).

  forward(q[B, L, N, H], k[B, S, K, H], v[B, S, K, H], q_seg[B, L], kv_seg[B, S], causal, scale)
    → o[B, L, N, H], lse[B, N, L]
  backward(q, k, v, do, lse, delta, q_seg, kv_seg, causal, scale) → dq, dk, dv

the same outputs, semantics and residuals as kernels/flash_attention.py's: causal is
bottom-right aligned (queries are the last L of the S positions), query head n reads key/value
head n // G (grouped-query heads, K/V never repeated), segment ids mask across packed documents,
and a row with nothing to attend to gives zeros and lse = NEG. So either file's backward takes
either's (o, lse); `flash_attention(..., hopper=True)` runs these.

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
- the backward as two such kernels, recomputing p = exp(s − lse) rather than storing it: dq
  streams the key blocks a query block sees, dk/dv (grid S/64 × K × B) the query blocks of all
  G query heads that see a key block, summing the group in registers (no atomics, no second
  pass); pᵀ and dsᵀ are transposed views of the shared memory they are staged in.

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
WIDE = 1 << 30  # as kernels/flash_attention.py: a window no row reaches
LOG2E, LN2 = math.log2(math.e), math.log(2)
SWIZZLE = 128  # bytes: wgmma reads shared memory tiles of 8 rows × 128 bytes, swizzled
SHARED_MEMORY = 227 * 1024  # bytes a block may have on an H100 (sm_90's opt-in maximum)


def check(q_BLNH, k_BSKH, v_BSKH, *, block_q: int, block_k: int, causal: bool = True,
          window=None) -> None:
  """Raises ValueError, naming what to change, for shapes and dtypes this kernel does not take."""
  (B, L, N, H), (_, S, K, _) = q_BLNH.shape, k_BSKH.shape
  if window is not None and not causal:
    raise ValueError("a window is for causal attention (a local layer's)")
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


def _stages(kernel: str, stages: int | None, smem_for, block_k: int, H: int) -> int:
  """`stages` if its shared memory (smem_for(stages), bytes) fits an H100's block, else raises
  naming what to change; None: 2 (loads one block ahead) if that fits, else 1."""
  if stages is None:
    stages = 2 if smem_for(2) <= SHARED_MEMORY else 1
  if stages < 1:
    raise ValueError(f'stages={stages}: at least one shared-memory slot')
  if (smem := smem_for(stages)) > SHARED_MEMORY:
    raise ValueError(f'block_k={block_k}, stages={stages} at head_dim={H}: {kernel} needs {smem} '
                     "bytes of shared memory, over the H100's 227 KiB: fewer stages or a smaller "
                     'block_k')
  return stages


def _tiles(dtype):
  """The layout wgmma and the TMA read a shared-memory tile of `dtype` in: 8 rows of 128 bytes,
  swizzled."""
  return (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(SWIZZLE))


def _interpret(interpret: bool | None) -> bool:
  """None: interpret unless lowering for a GPU, as the platform of the mesh being traced under
  says (a process compiling for GPUs that are not here traces under theirs), else the default
  backend's."""
  if interpret is not None:
    return interpret
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, 'abstract_device', None)
  return (device.platform if device else jax.default_backend()) not in ('gpu', 'cuda')


def _unpack(refs, n_in: int, segments: bool, offset: bool, windowed: bool, n_out: int):
  """(inputs, (q_seg, kv_seg) refs or Nones, the offset ref or None, the window ref or None,
  outputs, scratch) of a kernel's refs, passed as: the n_in inputs, [q_seg, kv_seg], [q_offset],
  [window], the outputs, scratch."""
  refs = list(refs)
  ins, refs = refs[:n_in], refs[n_in:]
  ids = (refs.pop(0), refs.pop(0)) if segments else (None, None)
  offset_ref = refs.pop(0) if offset else None
  window_ref = refs.pop(0) if windowed else None
  return ins, ids, offset_ref, window_ref, refs[:n_out], refs[n_out:]


def _extra_args(q_seg_BL, kv_seg_BS, q_offset, window):
  """The kernel arguments after the plain inputs: segment ids, then the offset and the window,
  each as int32[1]."""
  ids = () if q_seg_BL is None else (q_seg_BL.astype(jnp.int32), kv_seg_BS.astype(jnp.int32))
  scalars = tuple(jnp.reshape(x, (1,)).astype(jnp.int32) for x in (q_offset, window)
                  if x is not None)
  return ids + scalars


def _read_window(window_ref):
  """The window the input holds, WIDE for 0 (a global layer's: no window); None without one."""
  if window_ref is None:
    return None
  return jnp.where(window_ref[0] > 0, window_ref[0], WIDE)


def forward(q_BLNH, k_BSKH, v_BSKH, q_seg_BL=None, kv_seg_BS=None, *, causal: bool, scale: float,
            q_offset=None, window=None, out_dtype=None, block_q: int = 64, block_k: int = 128,
            stages: int | None = None, interpret: bool | None = None):
  """(o[B, L, N, H], lse[B, N, L]): see the module docstring. Segment ids both or neither.

  q_offset: causal only, the key index of query 0, an int32 that may be known only at run time
  (a device's share of a sequence split); None: S − L (bottom-right aligned).
  window: causal only, a local layer's sliding window (a query sees the W keys ending at its
  own), an int or an int32 known at run time, 0 for none; the key blocks wholly outside it are
  neither loaded nor computed.
  out_dtype: o's dtype (float32 for a part of an attention merged with others by its lse);
  None: the inputs'. stages: shared-memory slots of K and V (None: 2 where they fit, else 1).
  interpret: run Mosaic GPU's interpreter (True) or lower for the GPU (False); None lowers for
  the GPU when traced for one (`_interpret`). Not chosen per platform at lowering
  (`lax.platform_dependent`), as the Triton kernel is: the interpreter's callbacks are effects a
  platform-dependent branch cannot carry."""
  check(q_BLNH, k_BSKH, v_BSKH, block_q=block_q, block_k=block_k, causal=causal, window=window)
  if (q_seg_BL is None) != (kv_seg_BS is None):
    raise ValueError('give both segment id arrays (query and key) or neither')
  segments, positions, windowed = q_seg_BL is not None, q_offset is not None, window is not None
  (B, L, N, H), (_, S, K, _) = q_BLNH.shape, k_BSKH.shape
  group, n_kv = N // K, S // block_k
  dtype = q_BLNH.dtype
  out_dtype = jnp.dtype(out_dtype or dtype)
  staged = out_dtype != dtype  # o staged in a buffer of its own, else in Q's
  size = dtype.itemsize
  stages = _stages('the forward', stages, lambda n: (
      (block_q * H + 2 * n * block_k * H + block_q * block_k) * size
      + 4 * (block_q + n * block_k + block_q) + staged * block_q * H * out_dtype.itemsize),
      block_k, H)

  def flash_attention_hopper_fwd(*refs):
    (q_ref, k_ref, v_ref), (qs_ref, ks_ref), offset_ref, window_ref, (o_ref, lse_ref), \
        scratch = _unpack(refs, 3, segments, positions, windowed, 2)
    (q_smem, k_smem, v_smem, p_smem, qs_smem, ks_smem, lse_smem, q_bar, k_bar, v_bar, consumed,
     *o_staging) = scratch
    i, head, b = lax.axis_index('q'), lax.axis_index('head'), lax.axis_index('batch')
    offset = offset_ref[0] if positions else S - L
    window = _read_window(window_ref)
    first_row = i * block_q
    steps, full = _key_blocks(first_row, block_q, block_k, n_kv, causal, offset)
    lower, clear = _window_blocks(first_row, block_q, block_k, offset, window, full)

    @pl.when(lax.axis_index('wg') == 1)
    def _producer():
      _produce_keys(b, head // group, block_k, lower, steps, stages, consumed,
                    (k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar),
                    (ks_ref, ks_smem) if segments else None)

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

      def attend(step, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(step - lower, stages)
        plgpu.barrier_wait(k_bar.at[slot])

        s = _matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (block_q, block_k))
        s = s * (scale * LOG2E)
        k_seg = plgpu.load(ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)) if segments \
            else None
        visible = _visible(first_row, step * block_k, s.shape, offset if masked else None,
                           q_seg, k_seg, window if masked else None)
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

        o = _matmul(p_smem, v_smem.at[slot], (block_q, H))
        plgpu.barrier_arrive(consumed.at[slot])  # K, V and key ids of this slot are read
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o, m_new, l

      # The key blocks at the window's edge, those wholly within every row's window and before
      # its diagonal (no mask), then those the diagonal crosses
      carry = (acc, m, l)
      if windowed:
        carry = lax.fori_loop(lower, clear, lambda j, c: attend(j, c, masked=True), carry)
      carry = lax.fori_loop(clear, full, lambda j, c: attend(j, c, masked=False), carry)
      acc, m, l = lax.fori_loop(full, steps,
                                lambda j, c: attend(j, c, masked=True), carry)
      seen = l > 0.0
      acc = acc / lax.broadcast_in_dim(jnp.where(seen, l, 1.0), acc.shape, [0])
      out_smem = o_staging[0] if staged else q_smem  # Q is no longer read: it may stage o
      out_smem[...] = acc.astype(out_dtype)
      lse_smem[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, NEG)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, o_ref.at[b, rows, head])
      plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, head, rows])
      plgpu.wait_smem_to_gmem(0)

  loads = 2 if segments else 1  # TMA copies completing each of q_bar and k_bar[slot]
  tiles = _tiles(dtype)
  scratch = [
      plgpu.SMEM((block_q, H), dtype, transforms=tiles),
      plgpu.SMEM((stages, block_k, H), dtype, transforms=tiles),
      plgpu.SMEM((stages, block_k, H), dtype, transforms=tiles),
      plgpu.SMEM((block_q, block_k), dtype, transforms=tiles),
      plgpu.SMEM((block_q,), jnp.int32), plgpu.SMEM((stages, block_k), jnp.int32),
      plgpu.SMEM((block_q,), jnp.float32),
      plgpu.Barrier(num_arrivals=loads), plgpu.Barrier(num_arrivals=loads, num_barriers=stages),
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)]
  if staged:
    scratch.append(plgpu.SMEM((block_q, H), out_dtype, transforms=_tiles(out_dtype)))
  out_type = (jax.ShapeDtypeStruct((B, L, N, H), out_dtype),
              jax.ShapeDtypeStruct((B, N, L), jnp.float32))
  args = (q_BLNH, k_BSKH, v_BSKH) + _extra_args(q_seg_BL, kv_seg_BS, q_offset, window)
  return _launch(flash_attention_hopper_fwd, args, out_type, scratch, (L // block_q, N, B), 'q',
                 interpret)


def _launch(kernel, args, out_type, scratch, grid, blocks, interpret):
  """A grid of blocks of two warpgroups ('wg' 0 computes, 1 loads), named (`blocks`, 'head',
  'batch'); interpreted where asked (None: `_interpret`). The kernel's
  name is the program's op name, which planning/timing.py charges as attention."""
  interpret = _interpret(interpret)
  return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, grid=grid,
                      grid_names=(blocks, 'head', 'batch'), num_threads=2, thread_name='wg',
                      interpret=plgpu.InterpretGPUParams() if interpret else None,
                      compiler_params=plgpu.CompilerParams(approx_math=True))(*args)


def _key_blocks(first_row, block_q, block_k, n_kv, causal, offset):
  """(steps, full): the key blocks a query block from `first_row` sees: all, or (causal, query r
  at key r + offset) up to the one holding its last row's diagonal. Below `full` no key is past
  any row's diagonal, so those blocks need no mask."""
  if not causal:
    return jnp.int32(n_kv), jnp.int32(n_kv)
  steps = jnp.clip(pl.cdiv(first_row + block_q + offset, block_k), 0, n_kv)
  return steps, jnp.clip((first_row + offset + 1) // block_k, 0, steps)


def _window_blocks(first_row, block_q, block_k, offset, window, full):
  """(lower, clear) of a query block's key blocks within a `window` (None: (0, 0)): the first
  block its first row's window reaches, and the first from which every key is within its last
  row's (so blocks clear … full take no mask). Row r sees keys r + offset − W < c ≤ r + offset."""
  if window is None:
    return jnp.int32(0), jnp.int32(0)
  lower = jnp.clip((first_row + offset - window + 1) // block_k, 0, full)
  return lower, jnp.clip(pl.cdiv(first_row + block_q + offset - window, block_k), lower, full)


def _query_blocks_seeing(first_key, block, n_q, causal, offset, window):
  """(first, end): the query blocks (of `block` rows) whose rows see some key of the block from
  `first_key`: from the first at or past its diagonal (causal, else 0) to past the last whose
  window reaches its last key (all without a window)."""
  first = jnp.clip((first_key - offset) // block, 0, n_q) if causal else jnp.int32(0)
  if window is None:
    return first, jnp.int32(n_q)
  return first, jnp.clip((first_key + block - 1 - offset + window - 1) // block + 1, first, n_q)


def _produce_keys(b, kv_head, block_k, first, end, stages, consumed, k, v, key_ids):
  """The producer of the kernels that stream key blocks first … end − 1: K (and the key segment
  ids) complete one barrier of the slot, V the other, so the consumer starts on Q·Kᵀ before V
  lands. k, v: (gmem ref, smem ring, barrier ring); key_ids: (gmem ref, smem ring) or None."""
  keys = lambda step: (b, pl.ds((first + step) * block_k, block_k))
  (k_ref, k_ring, k_bar), (v_ref, v_ring, v_bar) = k, v
  copies = [(lambda step: k_ref.at[(*keys(step), kv_head)], k_ring, k_bar),
            (lambda step: v_ref.at[(*keys(step), kv_head)], v_ring, v_bar)]
  if key_ids:
    copies.insert(1, (lambda step: key_ids[0].at[keys(step)], key_ids[1], k_bar))
  _produce(end - first, stages, consumed, copies)


def _produce(steps, stages, consumed, copies):
  """The producer warpgroup's loop: for each step, once the consumer has freed its slot of the
  ring (after the first `stages`), one TMA copy per (gmem ref of the step, smem ring, barrier
  ring) in `copies` into that slot."""
  @pl.loop(0, steps)
  def _(step):
    slot = lax.rem(step, stages)

    @pl.when(step >= stages)
    def _():  # the consumer is done with what this slot held
      plgpu.barrier_wait(consumed.at[slot])
    for source, ring, barriers in copies:
      plgpu.copy_gmem_to_smem(source(step), ring.at[slot], barriers.at[slot])


def _visible(rows_at, keys_at, shape, causal_offset, q_seg, k_seg, window=None):
  """The mask of a [query rows, keys] block whose first row is query `rows_at` and first key
  `keys_at` (None: everything visible): causal (key c seen by row r when c ≤ r + offset), within
  the `window` (r + offset − c < W; causal only) and same-segment, in the wgmma accumulator's
  layout."""
  visible = None
  if causal_offset is not None:
    r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    c = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    distance = r + (rows_at + causal_offset - keys_at) - c
    visible = distance >= 0
    if window is not None:
      visible &= distance < window
  if q_seg is not None:
    same = (lax.broadcast_in_dim(q_seg, shape, [0]) == lax.broadcast_in_dim(k_seg, shape, [1]))
    visible = same if visible is None else visible & same
  return visible


def _matmul(a_smem, b_smem, shape):
  """a @ b on the tensor cores (wgmma, operands in shared memory) into fp32 registers."""
  def run(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    return acc_ref[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def backward(q_BLNH, k_BSKH, v_BSKH, do_BLNH, lse_BNL, delta_BNL, q_seg_BL=None, kv_seg_BS=None,
             *, causal: bool, scale: float, q_offset=None, window=None, out_dtype=None,
             block: int = 64, stages: int | None = None, interpret: bool | None = None):
  """(dq, dk, dv) in `out_dtype` (None: the inputs'), from the forward's lse and delta = rowsum(do ⊙ o), as
  kernels/flash_attention.py's backward computes them: p = exp(s − lse) recomputed block by
  block, never stored. Two kernels, each a TMA producer and a wgmma consumer as the forward:
    dq  (grid L/64 × N × B): a query block against the key blocks it sees,
        dq = Σ_j ds_j k_j · scale, ds = p ⊙ (do·vᵀ − Δ);
    dkv (grid S/64 × K × B): a key block against every query block of its G query heads that
        sees it, dv = Σ pᵀ do, dk = Σ dsᵀ q · scale, summed over the group in registers.
  The transposes pᵀ, dsᵀ are views of the shared memory p and ds are staged in, not copies.
  q_offset, window, stages and interpret as the forward's (the blocks outside a window skipped
  by both kernels); the lse and delta may be a whole row's, over
  keys this call does not see (a part of a ring's attention): then these are that row's
  gradients' shares from these keys."""
  check(q_BLNH, k_BSKH, v_BSKH, block_q=block, block_k=block, causal=causal, window=window)
  segments, positions, windowed = q_seg_BL is not None, q_offset is not None, window is not None
  (B, L, N, H), (_, S, K, _) = q_BLNH.shape, k_BSKH.shape
  group, n_q, n_kv = N // K, L // block, S // block
  dtype = q_BLNH.dtype
  out_dtype = jnp.dtype(out_dtype or dtype)
  staged = out_dtype != dtype  # dq, dk, dv staged in a buffer of their own, else in Q's, K's, V's
  size, out_tile = dtype.itemsize, staged * block * H * out_dtype.itemsize
  # dq: q, do, a ring of k, v, then ds; dk/dv: k, v, a ring of q, do, then p, ds (and ids, lse,
  # delta: 4 bytes a row or key). dk and dv take turns in one staging buffer.
  dq_stages = _stages('the dq kernel', stages, lambda n: (
      ((2 + 2 * n) * block * H + block ** 2) * size + 4 * (3 + n) * block + out_tile), block, H)
  dkv_stages = _stages('the dk/dv kernel', stages, lambda n: (
      ((2 + 2 * n) * block * H + 2 * block ** 2) * size + 4 * (1 + 3 * n) * block + out_tile),
      block, H)
  tiles = _tiles(dtype)
  log2_scale = scale * LOG2E
  row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  square = (block, block)

  def probabilities(s, lse, visible):
    p = jnp.exp2(s * log2_scale - lax.broadcast_in_dim(lse * LOG2E, s.shape, [0]))
    return p if visible is None else jnp.where(visible, p, 0.0)  # lse = NEG rows see nothing

  def flash_attention_hopper_dq(*refs):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qs_ref, ks_ref), offset_ref, window_ref, \
        (dq_ref,), scratch = _unpack(refs, 6, segments, positions, windowed, 1)
    (q_smem, do_smem, k_smem, v_smem, ds_smem, lse_smem, delta_smem, qs_smem, ks_smem,
     q_bar, k_bar, v_bar, consumed, *dq_staging) = scratch
    i, head, b = lax.axis_index('q'), lax.axis_index('head'), lax.axis_index('batch')
    offset = offset_ref[0] if positions else S - L
    window = _read_window(window_ref)
    first_row = i * block
    steps, full = _key_blocks(first_row, block, block, n_kv, causal, offset)
    lower, clear = _window_blocks(first_row, block, block, offset, window, full)

    @pl.when(lax.axis_index('wg') == 1)
    def _producer():
      _produce_keys(b, head // group, block, lower, steps, dq_stages, consumed,
                    (k_ref, k_smem, k_bar), (v_ref, v_smem, v_bar),
                    (ks_ref, ks_smem) if segments else None)

    @pl.when(lax.axis_index('wg') == 0)
    def _consumer():
      rows = pl.ds(first_row, block)
      plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], q_smem, q_bar)
      plgpu.copy_gmem_to_smem(do_ref.at[b, rows, head], do_smem, q_bar)
      plgpu.copy_gmem_to_smem(lse_ref.at[b, head, rows], lse_smem, q_bar)
      plgpu.copy_gmem_to_smem(delta_ref.at[b, head, rows], delta_smem, q_bar)
      if segments:
        plgpu.copy_gmem_to_smem(qs_ref.at[b, rows], qs_smem, q_bar)
      plgpu.barrier_wait(q_bar)
      lse = plgpu.load(lse_smem, layout=row_layout)
      delta = plgpu.load(delta_smem, layout=row_layout)
      q_seg = plgpu.load(qs_smem, layout=row_layout) if segments else None

      def step_(step, dq, masked: bool):
        slot = lax.rem(step - lower, dq_stages)
        plgpu.barrier_wait(k_bar.at[slot])
        s = _matmul(q_smem, k_smem.at[slot].transpose((1, 0)), square)
        k_seg = plgpu.load(ks_smem.at[slot], layout=col_layout) if segments else None
        p = probabilities(s, lse, _visible(first_row, step * block, square,
                                           offset if masked else None, q_seg, k_seg,
                                           window if masked else None))
        plgpu.barrier_wait(v_bar.at[slot])
        dp = _matmul(do_smem, v_smem.at[slot].transpose((1, 0)), square)
        ds_smem[...] = (p * (dp - lax.broadcast_in_dim(delta, square, [0]))).astype(dtype)
        plgpu.commit_smem()
        dq = dq + _matmul(ds_smem, k_smem.at[slot], (block, H))
        plgpu.barrier_arrive(consumed.at[slot])
        return dq

      dq = plgpu.layout_cast(jnp.zeros((block, H), jnp.float32), plgpu.Layout.WGMMA)
      if windowed:  # the blocks at the window's edge, then as the forward's loops
        dq = lax.fori_loop(lower, clear, lambda j, dq: step_(j, dq, masked=True), dq)
      dq = lax.fori_loop(clear, full, lambda j, dq: step_(j, dq, masked=False), dq)
      dq = lax.fori_loop(full, steps, lambda j, dq: step_(j, dq, masked=causal), dq)
      out_smem = dq_staging[0] if staged else q_smem  # Q is no longer read: it may stage dq
      out_smem[...] = (dq * scale).astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, dq_ref.at[b, rows, head])
      plgpu.wait_smem_to_gmem(0)

  def flash_attention_hopper_dkv(*refs):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), (qs_ref, ks_ref), offset_ref, window_ref, \
        (dk_ref, dv_ref), scratch = _unpack(refs, 6, segments, positions, windowed, 2)
    (k_smem, v_smem, q_smem, do_smem, p_smem, ds_smem, lse_smem, delta_smem, qs_smem, ks_smem,
     kv_bar, q_bar, do_bar, consumed, *dkv_staging) = scratch
    j, kv_head, b = lax.axis_index('k'), lax.axis_index('head'), lax.axis_index('batch')
    offset = offset_ref[0] if positions else S - L
    window = _read_window(window_ref)
    first_key = j * block
    # The query blocks that see key block j; each of the G heads sharing this kv head brings
    # its own of them.
    first, end = _query_blocks_seeing(first_key, block, n_q, causal, offset, window)
    per_head = end - first
    steps = group * per_head
    where = lambda t: (kv_head * group + lax.div(t, per_head),
                       pl.ds((first + lax.rem(t, per_head)) * block, block))

    @pl.when(lax.axis_index('wg') == 1)
    def _producer():
      def rows_of(ref):
        return lambda t: ref.at[b, where(t)[1], where(t)[0]]

      def row_vector(ref):
        return lambda t: ref.at[b, where(t)[0], where(t)[1]]
      copies = [(rows_of(q_ref), q_smem, q_bar), (row_vector(lse_ref), lse_smem, q_bar),
                (rows_of(do_ref), do_smem, do_bar), (row_vector(delta_ref), delta_smem, do_bar)]
      if segments:
        copies.insert(2, (lambda t: qs_ref.at[b, where(t)[1]], qs_smem, q_bar))
      _produce(steps, dkv_stages, consumed, copies)

    @pl.when(lax.axis_index('wg') == 0)
    def _consumer():
      keys = pl.ds(first_key, block)
      plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv_head], k_smem, kv_bar)
      plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv_head], v_smem, kv_bar)
      if segments:
        plgpu.copy_gmem_to_smem(ks_ref.at[b, keys], ks_smem, kv_bar)
      plgpu.barrier_wait(kv_bar)
      k_seg = plgpu.load(ks_smem, layout=col_layout) if segments else None

      def step_(t, carry):
        dk, dv = carry
        slot = lax.rem(t, dkv_stages)
        plgpu.barrier_wait(q_bar.at[slot])
        s = _matmul(q_smem.at[slot], k_smem.transpose((1, 0)), square)
        lse = plgpu.load(lse_smem.at[slot], layout=row_layout)
        q_seg = plgpu.load(qs_smem.at[slot], layout=row_layout) if segments else None
        rows_at = (first + lax.rem(t, per_head)) * block
        p = probabilities(s, lse, _visible(rows_at, first_key, square,
                                           offset if causal else None, q_seg, k_seg, window))
        p_smem[...] = p.astype(dtype)
        plgpu.barrier_wait(do_bar.at[slot])
        delta = plgpu.load(delta_smem.at[slot], layout=row_layout)
        dp = _matmul(do_smem.at[slot], v_smem.transpose((1, 0)), square)
        ds_smem[...] = (p * (dp - lax.broadcast_in_dim(delta, square, [0]))).astype(dtype)
        plgpu.commit_smem()
        dv = dv + _matmul(p_smem.transpose((1, 0)), do_smem.at[slot], (block, H))
        dk = dk + _matmul(ds_smem.transpose((1, 0)), q_smem.at[slot], (block, H))
        plgpu.barrier_arrive(consumed.at[slot])
        return dk, dv

      zeros = plgpu.layout_cast(jnp.zeros((block, H), jnp.float32), plgpu.Layout.WGMMA)
      dk, dv = lax.fori_loop(0, steps, step_, (zeros, zeros))
      if staged:  # dk, then dv, through the one staging buffer
        for grad, ref in ((dk * scale, dk_ref), (dv, dv_ref)):
          dkv_staging[0][...] = grad.astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(dkv_staging[0], ref.at[b, keys, kv_head])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # read out: free for dv
      else:  # K and V are no longer read: they stage dk, dv
        k_smem[...] = (dk * scale).astype(dtype)
        v_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, keys, kv_head])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, keys, kv_head])
      plgpu.wait_smem_to_gmem(0)

  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=tiles)
  vector = lambda *shape, dt=jnp.float32: plgpu.SMEM(shape, dt)
  arrivals = 5 if segments else 4  # the query block's q, do, lse, delta (and segment ids)
  staging = [plgpu.SMEM((block, H), out_dtype, transforms=_tiles(out_dtype))] if staged else []
  n = dq_stages
  dq_scratch = [tile(block, H), tile(block, H), tile(n, block, H), tile(n, block, H),
                tile(block, block), vector(block), vector(block), vector(block, dt=jnp.int32),
                vector(n, block, dt=jnp.int32),
                plgpu.Barrier(num_arrivals=arrivals),
                plgpu.Barrier(num_arrivals=2 if segments else 1, num_barriers=n),
                plgpu.Barrier(num_barriers=n), plgpu.Barrier(num_barriers=n), *staging]
  args = (q_BLNH, k_BSKH, v_BSKH, do_BLNH, lse_BNL, delta_BNL,
          *_extra_args(q_seg_BL, kv_seg_BS, q_offset, window))
  dq, = _launch(flash_attention_hopper_dq, args,
                (jax.ShapeDtypeStruct(q_BLNH.shape, out_dtype),), dq_scratch, (n_q, N, B), 'q',
                interpret)
  n = dkv_stages
  dkv_scratch = [tile(block, H), tile(block, H), tile(n, block, H),
                 tile(n, block, H), tile(block, block), tile(block, block),
                 vector(n, block), vector(n, block),
                 vector(n, block, dt=jnp.int32), vector(block, dt=jnp.int32),
                 plgpu.Barrier(num_arrivals=3 if segments else 2),
                 plgpu.Barrier(num_arrivals=3 if segments else 2, num_barriers=n),
                 plgpu.Barrier(num_arrivals=2, num_barriers=n),
                 plgpu.Barrier(num_barriers=n), *staging]
  dk, dv = _launch(flash_attention_hopper_dkv, args,
                   (jax.ShapeDtypeStruct(k_BSKH.shape, out_dtype),) * 2, dkv_scratch,
                   (n_kv, K, B), 'k', interpret)
  return dq, dk, dv
