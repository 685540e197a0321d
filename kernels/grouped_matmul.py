"""Grouped matmul in Pallas: a mixture-of-experts layer's expert GEMMs, group sizes known only at
run time.

  grouped_matmul(x[M, K], w[G, K, N], group_sizes[G]) → y[M, N]

Rows are sorted by group: the size_g rows from start_g = size_0 + … + size_{g−1} are multiplied
by w[g]. Rows past the last group (the padding of a dropless layer's buffer) give zeros. bf16 (or
fp32) operands, fp32 accumulation, y in x's dtype. No [M, G, N] or [M, G·N] buffer exists at any
point: every row is multiplied by its own group's weight only.

Forward (grid W × N/bn). The row tiles (bm rows, aligned) that each group touches are listed as
work items: (tile, group, first row, end row). A tile a group boundary crosses is one item per
group, so W ≤ M/bm + G, a bound known when tracing; unused items do nothing. An item multiplies
its tile by its group's weight, looping over K in steps of bk, and stores only its group's rows
(a masked store), so the items sharing a tile never write each other's rows. One pseudo-group
after the last covers the padding rows and stores zeros there.
Backward (jax.custom_vjp):
  dx = grouped_matmul(dy, wᵀ): the same kernel against the transposed weights;
  dw[g] = x_gᵀ dy_g: grid G × K/bk × N/bn, each program walking its group's row tiles with the
  rows of other groups masked to zero; an empty group's dw[g] is zero.

Lowered as the attention kernel is (kernels/flash_attention.py): Triton when compiled for CUDA,
interpret mode elsewhere, so the CPU tests run every line the GPU runs.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from configs.base import EXPERT_MATMULS
from kernels.flash_attention import pallas_for_platform

IMPLEMENTATIONS = EXPERT_MATMULS  # ours, XLA's, and a one-hot reference (config.model.expert_matmul)


class Blocks(NamedTuple):
  """Tiles and launch: bm rows, bk of the contraction, bn output columns; Triton's warps and
  stages (interpret mode uses only the tiles)."""
  bm: int = 64
  bk: int = 64
  bn: int = 128
  num_warps: int = 4
  num_stages: int = 3


def _fit(size: int, requested: int) -> int:
  """The largest power of two ≤ requested that divides size (Triton's dot needs ≥ 16)."""
  block = requested
  while block > 16 and size % block:
    block //= 2
  if size % block:
    raise ValueError(f'grouped_matmul: a dimension of {size} is not a multiple of 16; the '
                     'expert width and d_model must be')
  return block


class _Static(NamedTuple):
  blocks: Blocks
  interpret: bool | None
  filled: float = 1.0

  def name(self, kernel: str) -> str:
    """The kernel's name, with the share of its rows expected filled where not all: the time
    model (planning/timing.py) reads it there, as the group sizes are known only at run time."""
    return kernel if self.filled >= 1 else f'{kernel}_filled{round(self.filled * 1e4)}'

  def launch(self):
    return dict(interpret=self.interpret, num_warps=self.blocks.num_warps,
                num_stages=self.blocks.num_stages)


def _bounds(group_sizes):
  """(starts, ends) of each group's rows, int32[G]."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return ends - group_sizes.astype(jnp.int32), ends


def _work_items(group_sizes, rows: int, bm: int):
  """int32[W] each: the row tile, the group (G: the padding's pseudo-group), and the rows
  [lo, hi) of that group in that tile; items past the last have lo = hi."""
  G = group_sizes.shape[0]
  starts, ends = _bounds(group_sizes)
  starts = jnp.concatenate([starts, ends[-1:]])
  ends = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)])
  first = starts // bm
  count = jnp.where(ends > starts, (ends + bm - 1) // bm - first, 0)
  before = jnp.cumsum(count) - count  # items of the groups before this one
  item = jnp.arange(rows // bm + G, dtype=jnp.int32)
  group = jnp.clip(jnp.searchsorted(jnp.cumsum(count), item, side='right'), 0, G).astype(jnp.int32)
  tile = first[group] + item - before[group]
  used = item < count.sum()
  lo = jnp.where(used, jnp.maximum(starts[group], tile * bm), 0)
  hi = jnp.where(used, jnp.minimum(ends[group], tile * bm + bm), 0)
  return jnp.where(used, tile, 0), group, lo, hi


def _count_if(cond, n):
  """n where cond, else 0, as an int32 loop bound. A product, not jnp.where: Triton's lowering
  gives a scalar select the condition's type (i1), which a loop cannot take as a bound."""
  return n * cond.astype(jnp.int32)


def _gmm_kernel(tile_ref, group_ref, lo_ref, hi_ref, x_ref, w_ref, y_ref, *, bm, bk, bn,
                n_groups, n_k):
  i, j = pl.program_id(0), pl.program_id(1)
  tile, g, lo, hi = tile_ref[i], group_ref[i], lo_ref[i], hi_ref[i]
  weighted = g < n_groups  # the padding's pseudo-group stores zeros
  w_g = jnp.minimum(g, n_groups - 1)
  rows, cols = pl.ds(tile * bm, bm), pl.ds(j * bn, bn)

  def body(k, acc):
    x = x_ref[rows, pl.ds(k * bk, bk)]
    w = w_ref[w_g, pl.ds(k * bk, bk), cols]
    return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, _count_if(weighted & (hi > lo), n_k), body, jnp.zeros((bm, bn), jnp.float32))
  row = tile * bm + jnp.arange(bm)
  mine = jnp.broadcast_to(((row >= lo) & (row < hi))[:, None], (bm, bn))
  pltriton.store(y_ref.at[rows, cols], acc.astype(y_ref.dtype), mask=mine)


def _gmm(x, w, group_sizes, st: _Static):
  """y = grouped x·w on rows padded to whole tiles (x.shape[0] % bm == 0)."""
  M, K = x.shape
  G, _, N = w.shape
  bm, bk, bn = st.blocks.bm, _fit(K, st.blocks.bk), _fit(N, st.blocks.bn)
  items = _work_items(group_sizes, M, bm)
  whole = pl.BlockSpec()  # the kernel indexes the whole array
  kernel = functools.partial(_gmm_kernel, bm=bm, bk=bk, bn=bn, n_groups=G, n_k=K // bk)
  return pallas_for_platform(
      kernel, [*items, x, w], grid=(items[0].shape[0], N // bn), in_specs=[whole] * 6,
      out_specs=whole, out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
      name=st.name('grouped_matmul'), **st.launch())


def _tgmm_kernel(starts_ref, ends_ref, x_ref, dy_ref, dw_ref, *, bm, bk, bn):
  g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  lo, hi = starts_ref[g], ends_ref[g]
  first = jax.lax.div(lo, bm)  # lax's truncating div: Triton fails on jnp's flooring one
  tiles = _count_if(hi > lo, jax.lax.div(hi + bm - 1, bm) - first)

  def body(t, acc):
    start = (first + t) * bm
    row = start + jnp.arange(bm)
    x = x_ref[pl.ds(start, bm), pl.ds(a * bk, bk)]
    x = jnp.where(((row >= lo) & (row < hi))[:, None], x, jnp.zeros_like(x))
    dy = dy_ref[pl.ds(start, bm), pl.ds(b * bn, bn)]
    return acc + jnp.dot(x.T, dy, preferred_element_type=jnp.float32)

  dw_ref[...] = jax.lax.fori_loop(0, tiles, body,
                                  jnp.zeros((bk, bn), jnp.float32)).astype(dw_ref.dtype)


def _tgmm(x, dy, group_sizes, w_dtype, st: _Static):
  """dw[g] = x_gᵀ dy_g, [G, K, N] in w_dtype."""
  M, K = x.shape
  N = dy.shape[1]
  G = group_sizes.shape[0]
  bm, bk, bn = st.blocks.bm, _fit(K, st.blocks.bk), _fit(N, st.blocks.bn)
  whole = pl.BlockSpec()
  return pallas_for_platform(
      functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn), [*_bounds(group_sizes), x, dy],
      grid=(G, K // bk, N // bn), in_specs=[whole] * 4,
      out_specs=pl.BlockSpec((pl.squeezed, bk, bn), lambda g, a, b: (g, a, b)),
      out_shape=jax.ShapeDtypeStruct((G, K, N), w_dtype), name=st.name('grouped_matmul_dw'),
      **st.launch())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(x, w, group_sizes, st):
  return _gmm(x, w, group_sizes, st)


def _grouped_fwd(x, w, group_sizes, st):
  return _gmm(x, w, group_sizes, st), (x, w, group_sizes)


def _grouped_bwd(st, residuals, dy):
  x, w, group_sizes = residuals
  dy = dy.astype(x.dtype)
  dx = _gmm(dy, jnp.swapaxes(w, 1, 2), group_sizes, st)
  dw = _tgmm(x, dy, group_sizes, w.dtype, st)
  return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, implementation: str = 'pallas',
                   blocks: Blocks = Blocks(), interpret: bool | None = None, filled: float = 1.0):
  """y[M, N]: rows of x sorted by group times their group's weight (module docstring); rows past
  Σ group_sizes give zeros. `implementation`: 'pallas' (ours), 'ragged_dot' (XLA's
  jax.lax.ragged_dot), 'dense' (every row times every weight, then its own picked: a reference
  that holds [M, G, N]). `filled`: the share of the M rows the caller expects the groups to
  fill (a buffer sized for the worst case), for the time model only."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'grouped_matmul: implementation={implementation!r} is not one of '
                     f'{IMPLEMENTATIONS}')
  if implementation == 'ragged_dot':
    return jax.lax.ragged_dot(x_MK, w_GKN.astype(x_MK.dtype), group_sizes_G.astype(jnp.int32),
                              preferred_element_type=jnp.float32).astype(x_MK.dtype)
  if implementation == 'dense':
    return dense_reference(x_MK, w_GKN, group_sizes_G)
  M = x_MK.shape[0]
  padded = -(-M // blocks.bm) * blocks.bm
  x = jnp.pad(x_MK, ((0, padded - M), (0, 0))) if padded != M else x_MK
  y = _grouped(x, w_GKN.astype(x.dtype), group_sizes_G.astype(jnp.int32),
               _Static(blocks, interpret, filled))
  return y[:M] if padded != M else y


def grouped_matmul_dw(x_MK, dy_MN, group_sizes_G, out_dtype, *, implementation: str = 'pallas',
                      blocks: Blocks = Blocks(), interpret: bool | None = None,
                      filled: float = 1.0):
  """dw[G, K, N] in `out_dtype`: dw[g] = x_gᵀ·dy_g over each group's rows (rows past Σ
  group_sizes take no part), accumulated in fp32. grouped_matmul's weight gradient, for a caller
  whose backward is its own (model/moe.py keeps fp32 partial sums to reduce across devices);
  the references take it from autodiff of their forward."""
  if implementation != 'pallas':
    zeros_GKN = jnp.zeros((group_sizes_G.shape[0], x_MK.shape[1], dy_MN.shape[1]), jnp.float32)
    forward = lambda w: grouped_matmul(x_MK.astype(jnp.float32), w, group_sizes_G,
                                       implementation=implementation)
    return jax.vjp(forward, zeros_GKN)[1](dy_MN.astype(jnp.float32))[0].astype(out_dtype)
  M = x_MK.shape[0]
  padded = -(-M // blocks.bm) * blocks.bm
  pad = lambda a: jnp.pad(a, ((0, padded - M), (0, 0))) if padded != M else a
  return _tgmm(pad(x_MK), pad(dy_MN.astype(x_MK.dtype)), group_sizes_G.astype(jnp.int32),
               out_dtype, _Static(blocks, interpret, filled))


def dense_reference(x_MK, w_GKN, group_sizes_G):
  """Every row times every group's weight, then each row's own group's product kept."""
  starts, ends = _bounds(group_sizes_G)
  row_M = jnp.arange(x_MK.shape[0])
  one_hot_MG = (row_M[:, None] >= starts) & (row_M[:, None] < ends)
  y_MGN = jnp.einsum('mk,gkn->mgn', x_MK, w_GKN.astype(x_MK.dtype),
                     preferred_element_type=jnp.float32)
  return jnp.einsum('mgn,mg->mn', y_MGN, one_hot_MG.astype(jnp.float32)).astype(x_MK.dtype)
