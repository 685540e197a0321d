"""Our Pallas flash attention (interpret mode on CPU) against the xla reference: values and
gradients, GQA, packed rows, padding, odd lengths, bf16; in the model, and under a sharded mesh."""

import functools
import importlib

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import flash_attention, xla_attention
import sharding
from tests.conftest import tiny_config
from training import programs
from training import settings
from training.state import build

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}  # bf16: inputs rounded, fp32 softmax


def inputs(B=2, L=40, S=40, N=4, K=4, H=16, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, L, N, H), dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), dtype)
  v = jax.random.normal(ks[2], (B, S, K, H), dtype)
  return q, k, v, jax.random.normal(ks[3], (B, L, N, H), jnp.float32)


def packed_segments(B, L):
  """Row 0: three documents; row 1: one document then padding (segment 0)."""
  seg = np.zeros((B, L), np.int32)
  seg[0, :L // 4], seg[0, L // 4:L - 5], seg[0, L - 5:] = 1, 2, 3
  seg[1, :L // 2] = 1
  return jnp.asarray(seg)


def compare(q, k, v, cotangent, *, causal, seg=None, kv_seg=None, window=None, ours_window=None,
            **blocks):
  """Outputs and (dq, dk, dv) of both implementations for loss = Σ out · cotangent; `window` the
  reference's, `ours_window` ours (an int32 array: one known at run time) where it differs."""
  def loss(fn, w, q, k, v):
    out = fn(q, k, v, causal=causal, segment_ids_BL=seg, kv_segment_ids_BS=kv_seg, window=w)
    return (out.astype(jnp.float32) * cotangent).sum(), out

  results = []
  for fn, w in ((functools.partial(flash_attention, **blocks),
                 window if ours_window is None else ours_window), (xla_attention, window)):
    (_, out), grads = jax.jit(jax.value_and_grad(functools.partial(loss, fn), (1, 2, 3),
                                                 has_aux=True))(w, q, k, v)
    results.append((out, *grads))
  tol = TOLERANCE[q.dtype.type]
  for name, ours, ref in zip(('out', 'dq', 'dk', 'dv'), *results):
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, name
    assert np.all(np.isfinite(np.asarray(ours, np.float32))), name
    scale = max(1.0, float(jnp.abs(ref.astype(jnp.float32)).max()))
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref, np.float32),
                               atol=tol * scale, rtol=tol, err_msg=name)
  return results


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('kv_heads', [4, 1])
@pytest.mark.parametrize('packed', [False, True])
def test_matches_reference_values_and_gradients(causal, kv_heads, packed):
  q, k, v, ct = inputs(K=kv_heads)  # L = 40: not a multiple of the 16-row blocks
  seg = packed_segments(2, 40) if packed else None
  compare(q, k, v, ct, causal=causal, seg=seg, block_q=16, block_k=16)


@pytest.mark.parametrize('window', [None, 17])
def test_ours_and_xlas_log_sum_exp_agree_and_leave_the_gradients_alone(window):
  """with_lse (QK-clip's measure): our kernel's and the XLA path's lse[B, N, L] of packed rows
  (a window too) agree, the output and its gradients are attention's without it (to fp32
  rounding), and the lse carries no gradient (its sum is in the loss)."""
  q, k, v, ct = inputs(K=2)
  seg = packed_segments(2, 40)
  got = {}
  for name, fn in (('ours', functools.partial(flash_attention, block_q=16, block_k=16)),
                   ('xla', xla_attention)):
    def loss(q, k, v, with_lse, fn=fn):
      out = fn(q, k, v, causal=True, segment_ids_BL=seg, window=window, with_lse=with_lse)
      out, lse = out if with_lse else (out, jnp.zeros(()))
      return (out * ct).sum() + lse.sum(), (out, lse)
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True),
                                     static_argnums=3)(q, k, v, True)
    (_, (plain, _)), plain_grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True),
                                           static_argnums=3)(q, k, v, False)
    for a, b in zip((out, *grads), (plain, *plain_grads)):  # (fused apart: fp32 rounding)
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    got[name] = lse
  assert got['ours'].shape == (2, 4, 40)
  seen = np.asarray(seg != 0)[:, None, :]  # padding rows: ours NEG, xla's a masked row's
  np.testing.assert_allclose(np.where(seen, got['ours'], 0), np.where(seen, got['xla'], 0),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('window,traced,packed', [
    (5, False, False), (17, True, True),
    *(pytest.param(*case, marks=pytest.mark.integration)
      for case in [(5, False, True), (17, True, False), (40, True, False), (40, True, True)])])
def test_a_sliding_window_matches_the_reference_values_and_gradients(window, traced, packed):
  """A local layer's window of W keys, fixed when compiled or known at run time (the scan of
  local and global layers hands each its own), with packed documents too."""
  q, k, v, ct = inputs(K=2)
  seg = packed_segments(2, 40) if packed else None
  compare(q, k, v, ct, causal=True, seg=seg, window=window,
          ours_window=jnp.int32(window) if traced else None, block_q=16, block_k=16)
  if traced:  # 0 at run time: a global layer's, all the keys
    compare(q, k, v, ct, causal=True, seg=seg, ours_window=jnp.int32(0), block_q=16, block_k=16)


def test_a_sliding_window_skips_the_key_blocks_outside_it_forward_and_backward():
  """Key block 0 (keys 0–15) lies outside the window of 5 of query blocks 2 and 3 (rows 32–63),
  and query block 3 outside that of key block 0: NaNs there reach no output the kernels skip
  them for, as they would if a loop ran over them (0 · NaN is NaN)."""
  q, k, v, ct = inputs(L=64, S=64, K=2)

  def grads(q, v, rows):
    def loss(q, k, v):
      out = flash_attention(q, k, v, causal=True, window=jnp.int32(5), block_q=16, block_k=16)
      return (out[:, rows] * ct[:, rows]).sum(), out
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

  # the forward and dq of rows 32–47 never read key block 0's values
  (_, out), (dq, _, _) = grads(q, v.at[:, :16].set(jnp.nan), slice(32, 48))
  assert np.isnan(out[:, :32]).all() and np.isfinite(out[:, 32:]).all()
  assert np.isfinite(dq[:, 32:48]).all()
  # key block 0's dk and dv never read query block 3's rows
  _, (_, dk, dv) = grads(q.at[:, 48:].set(jnp.nan), v, slice(0, 48))
  assert np.isfinite(dk[:, :16]).all() and np.isfinite(dv[:, :16]).all()
  assert np.isnan(dk[:, 48:]).all()  # which query block 3 does reach


@pytest.mark.parametrize('window,head_dim', [
    (512, 256), (1024, 128),
    *(pytest.param(*case, marks=pytest.mark.integration)
      for case in [(1024, 256), (4096, 128), (128, 64), (256, 64)])])
def test_a_windows_tiles_keep_the_keys_the_kernel_visits_within_what_it_allows(window, head_dim):
  """Counted from the kernel's loop bounds (benchmarks/windowed_attention.py) over a long row:
  forward, dq and dk/dv visit at most WINDOW_WASTE × the keys the window lets queries see, for
  windows of 128 keys and more (below, the smallest tiles, 16 × 16, are most of a window); the
  Hopper kernels' too for windows of 512 and more (Gemma 3's: their tiles stay 64 × 64)."""
  from benchmarks.windowed_attention import visited
  from kernels.flash_attention import WINDOW_WASTE
  counted = visited(2048 if window < 256 else 8192, window, head_dim)
  assert counted['forward_dq'] <= WINDOW_WASTE and counted['dkv'] <= WINDOW_WASTE, counted
  if window >= 512:
    assert max(counted['hopper'][part] for part in ('forward', 'dq', 'dkv')) <= WINDOW_WASTE


@pytest.mark.integration
def test_grouped_query_heads_with_unequal_blocks_and_long_rows():
  q, k, v, ct = inputs(B=1, L=100, S=100, N=8, K=2, H=32)  # G = 4 = N / 4
  compare(q, k, v, ct, causal=True, seg=packed_segments(2, 100)[:1], block_q=32, block_k=16)


@pytest.mark.integration
@pytest.mark.parametrize('L,S', [(24, 40), (40, 24)])
def test_query_and_key_lengths_may_differ(L, S):
  """Causal is bottom-right aligned; with L > S the first L - S queries see nothing: zeros."""
  q, k, v, ct = inputs(L=L, S=S, K=2)
  out = compare(q, k, v, ct, causal=True, block_q=16, block_k=16)[0][0]
  if L > S:
    assert np.all(np.asarray(out[:, :L - S]) == 0)
  compare(q, k, v, ct, causal=False, block_q=16, block_k=16)


def test_a_row_with_nothing_to_attend_to_gives_zeros_and_zero_gradients():
  q, k, v, ct = inputs(K=2)
  seg = jnp.ones((2, 40), jnp.int32)
  kv_seg = seg.at[1].set(2)  # row 1's queries match no key
  out, dq, dk, dv = compare(q, k, v, ct, causal=True, seg=seg, kv_seg=kv_seg, block_q=16,
                            block_k=16)[0]
  assert not np.any(out[1]) and not np.any(dq[1]) and not np.any(dk[1]) and not np.any(dv[1])


def test_bf16_inputs():
  q, k, v, ct = inputs(K=2, dtype=jnp.bfloat16)
  compare(q, k, v, ct, causal=True, seg=packed_segments(2, 40), block_q=16, block_k=16)


@pytest.mark.integration
def test_one_training_step_with_pallas_equals_xla():
  """On one device (sharded steps with the kernel: tests/test_context_parallel.py)."""
  runs = {}
  for implementation in ('xla', 'pallas'):
    config = tiny_config()
    config.model.attention = implementation
    setup = build(settings.resolve(config, jax.devices()[:1]))
    step = programs.compile_train_step(setup, config.batch_size, config.seq_len, 0.0)
    state, metrics = step(setup.init_state(), random_batch(setup, config))
    runs[implementation] = (float(metrics['loss']), float(metrics['grad_norm']),
                            np.asarray(state.params['blocks']['attn']['wq'][...]))
  (loss, norm, wq), (ref_loss, ref_norm, ref_wq) = runs['pallas'], runs['xla']
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(norm, ref_norm, rtol=1e-4)
  np.testing.assert_allclose(wq, ref_wq, rtol=1e-4, atol=1e-6)


def random_batch(setup, config):
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  segments = np.repeat(np.arange(1, 5), config.seq_len // 4)[None].repeat(shape[0], 0)
  host = {'inputs': rng.integers(0, 256, shape), 'targets': rng.integers(0, 256, shape),
          'positions': np.tile(np.arange(config.seq_len // 4), 4)[None].repeat(shape[0], 0),
          'segment_ids': segments, 'weights': np.ones(shape)}
  s = sharding.batch_sharding(setup.mesh)
  return {k: jax.device_put(np.asarray(v, programs.BATCH_KEYS[k]), s) for k, v in host.items()}


def test_sharded_over_batch_and_heads_equals_unsharded():
  """Under data=2 × tensor=4 the kernel runs per shard (shard_map): each device holds 1 of the
  batch rows and N/4 heads, and the result equals one device's."""
  q, k, v, _ = inputs(B=2, L=32, S=32, N=8, K=4, H=16)
  seg = packed_segments(2, 32)
  reference = flash_attention(q, k, v, causal=True, segment_ids_BL=seg)
  mesh = sharding.make_mesh(tiny_config(data=2, tensor=4).mesh, jax.devices())
  names = (('batch', None, 'heads', 'head_dim'), ('batch', None, 'kv_heads', 'head_dim'),
           ('batch', None))
  with jax.set_mesh(mesh), flax_rules():
    per_shard = sharding.per_shard(
        lambda q, k, v, s: flash_attention(q, k, v, causal=True, segment_ids_BL=s),
        (names[0], names[1], names[1], names[2]), names[0])
    fn = jax.jit(per_shard)
    put = lambda x, names: jax.device_put(x, jax.sharding.NamedSharding(
        mesh, flax.linen.logical_to_mesh_axes(names)))
    args = (put(q, names[0]), put(k, names[1]), put(v, names[1]), put(seg, names[2]))
    out = fn(*args)
    hlo = fn.lower(*args).compile().as_text()
  assert {s.data.shape for s in out.addressable_shards} == {(1, 32, 2, 16)}
  np.testing.assert_allclose(np.asarray(out), np.asarray(reference), rtol=1e-5, atol=1e-6)
  assert 'all-gather' not in hlo  # no device needed another's q, k or v


def flax_rules():
  from flax import nnx
  return nnx.logical_axis_rules(sharding.ACTIVATION_RULES)


def test_bad_block_size_names_the_field():
  config = tiny_config()
  config.model.attention_block_q = 48
  with pytest.raises(ValueError, match='config.model.attention_block_q'):
    build(settings.resolve(config))


def packed_rows(lengths_per_row, L, padded_rows=()):
  """Segment ids as data/packing.py lays rows: documents numbered from 1, end to end; the rows
  in `padded_rows` end in padding (0) after their documents."""
  rows = []
  for r, lengths in enumerate(lengths_per_row):
    row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] or [np.zeros(0)])
    assert len(row) == L or r in padded_rows
    rows.append(np.pad(row, (0, L - len(row))))
  return jnp.asarray(np.stack(rows), jnp.int32)


def test_packed_layout_gives_each_rows_document_offsets_with_padding_as_one_more():
  """cuDNN's packed layout (kernels/attention.py): each row's document starts and lengths, -1
  past its last; padding at a row's end is a document of its own (a token in none would get
  NaN gradients from cuDNN), which attends to itself as under the dense mask."""
  from kernels.attention import packed_layout
  ids = packed_rows([[5, 3, 8], [16], [4, 4]], 16, padded_rows=(2,))
  laid_out, starts, lengths = packed_layout(ids, 4)
  assert bool(laid_out)
  np.testing.assert_array_equal(starts, [[0, 5, 8, -1, -1], [0, -1, -1, -1, -1],
                                         [0, 4, 8, -1, -1]])
  np.testing.assert_array_equal(lengths, [[5, 3, 8, -1], [16, -1, -1, -1], [4, 4, 8, -1]])
  # The dense mask it replaces: same document, and causal within it.
  same = np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :]
  for b in range(3):
    for m in range(4):
      if lengths[b, m] > 0:
        block = slice(int(starts[b, m]), int(starts[b, m] + lengths[b, m]))
        assert same[b, block, block].all() and same[b, block].sum() == lengths[b, m] ** 2


@pytest.mark.parametrize('rows,why', [
    ([[1, 1, 2, 2, 3, 3, 4, 0]], 'four documents and the padding: more than 4'),
    ([[1, 1, 2, 2, 1, 1, 3, 3]], 'a document in two places'),
    ([[2, 2, 3, 3, 3, 3, 3, 3]], 'not numbered from 1'),
    ([[1, 1, 3, 3, 3, 3, 3, 3]], 'a number skipped'),
    ([[1, 1, 0, 0, 2, 2, 2, 2]], 'padding before a document'),
])
def test_rows_cudnns_packed_layout_cannot_hold_take_the_dense_mask(rows, why):
  """A batch is laid out only when every row is: one that is not sends the step to the mask."""
  from kernels.attention import packed_layout
  ids = jnp.asarray(np.array(rows + [[1] * 8]), jnp.int32)
  assert not bool(packed_layout(ids, 4)[0]), why
  assert bool(packed_layout(jnp.asarray(np.array([[1] * 8, [1, 1, 2, 2, 3, 3, 4, 0]]),
                                        jnp.int32), 5)[0])  # 5 hold them


def cudnn_as_documented(monkeypatch):
  """cuDNN's two calls as JAX documents them, computed by XLA on the CPU: the dense path
  (jax.nn.dot_product_attention with a mask) and the packed layout, where a query at position i
  of document m (offset o_m, length l_m of its row) attends to the keys o_m … i; a position in no
  document attends to nothing."""
  module = importlib.import_module('kernels.attention')  # the package's `attention` is the function
  dense = jax.nn.dot_product_attention
  monkeypatch.setattr(jax.nn, 'dot_product_attention',
                      lambda *a, implementation=None, **kw: dense(*a, implementation='xla', **kw))

  def packed(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type,
             qkv_layout):
    assert (q_seqlen is kv_seqlen and q_offsets is kv_offsets and qkv_layout == 'BTNH'
            and mask_type == module.fused_attention.MaskType.PADDING_CAUSAL
            and scale == 1 / np.sqrt(q.shape[-1]))
    L = q.shape[1]
    position = jnp.arange(L)
    starts, lengths = q_offsets[:, :-1, None], q_seqlen[:, :, None]
    inside_BML = (lengths > 0) & (position >= starts) & (position < starts + lengths)
    document_BL = jnp.where(inside_BML.any(1), jnp.argmax(inside_BML, axis=1) + 1, 0)
    mask_BLS = ((document_BL[:, :, None] == document_BL[:, None, :])
                & (document_BL[:, :, None] > 0) & (position[:, None] >= position[None, :]))
    return module.masked_attention(q, k, v, mask_BLS)
  monkeypatch.setattr(module.fused_attention, 'dot_product_attention', packed)


@pytest.mark.parametrize('lengths,padded', [
    ([[5, 3, 8], [16], [4, 4, 4]], (2,)),  # laid out: the packed layout
    ([[2] * 8, [16], [16]], ()),  # eight documents in a row, more than 4: the dense mask
])
def test_cudnn_packed_rows_attend_as_the_segment_mask(monkeypatch, lengths, padded):
  """The offsets and lengths handed to cuDNN's packed layout, and the choice between it and the
  dense mask, give the attention (and gradients) of the segment mask: cuDNN's two calls as JAX
  documents them, run by XLA here (the GPU's equality: benchmarks/results/cudnn_packed_probe-h200.json)."""
  from kernels.attention import attention
  cudnn_as_documented(monkeypatch)
  ids = packed_rows(lengths, 16, padded_rows=padded)
  q, k, v = (jax.random.normal(jax.random.key(i), (3, 16, heads, 8))
             for i, heads in enumerate((4, 2, 2)))

  def loss(fn):
    return lambda q, k, v: (fn(q, k, v) * jnp.arange(8.0)).sum()
  cudnn = lambda q, k, v: attention(q, k, v, causal=True, implementation='cudnn',
                                    segment_ids_BL=ids, cudnn_segments=4)
  reference = lambda q, k, v: xla_attention(q, k, v, causal=True, segment_ids_BL=ids)
  np.testing.assert_allclose(jax.jit(cudnn)(q, k, v), reference(q, k, v), atol=1e-5)
  for ours, theirs in zip(jax.jit(jax.grad(loss(cudnn), (0, 1, 2)))(q, k, v),
                          jax.grad(loss(reference), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
