"""Our Hopper flash attention forward (kernels/flash_attention_hopper.py) in Mosaic GPU's interpret
mode, which simulates its two warpgroups, shared memory, TMA copies and barriers on the CPU:
values and log-sum-exp against the xla reference (causal and not, GQA, packed rows, L ≠ S, head
dims 64, 128, 256), gradients from its backward kernels, the shapes it refuses; and the same
kernels lowered for H100s that are not here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import flash_attention, flash_attention_hopper, xla_attention
from kernels import gathered_attention, ring_attention, zigzag_order
from kernels.flash_attention import attention_parts, attention_parts_grads
from planning import gpus, timing

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning')


def inputs(L=128, S=128, N=4, K=2, H=64, B=1, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, L, N, H), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.bfloat16)
  return q, k, v, jax.random.normal(ks[3], (B, L, N, H), jnp.float32)


def reference(q, k, v, causal, q_seg=None, kv_seg=None):
  """o and lse in fp32 from the bf16 inputs: the xla attention, and the log-sum-exp by hand."""
  f32 = lambda x: x.astype(jnp.float32)
  o = xla_attention(f32(q), f32(k), f32(v), causal=causal, segment_ids_BL=q_seg,
                    kv_segment_ids_BS=kv_seg)
  (B, L, N, H), (S, K) = q.shape, k.shape[1:3]
  s = jnp.einsum('blkgh,bskh->bkgls', f32(q).reshape(B, L, K, N // K, H), f32(k)) / H ** 0.5
  seen = jnp.ones((B, 1, 1, L, S), bool)
  if causal:
    seen &= (jnp.arange(S)[None, :] <= jnp.arange(L)[:, None] + S - L)[None, None, None]
  if q_seg is not None:
    seen &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None]
  lse = jax.nn.logsumexp(jnp.where(seen, s, -jnp.inf), axis=-1).reshape(B, N, L)
  return o, jnp.where(jnp.isfinite(lse), lse, flash_attention_hopper.NEG)


def packed(B, L, lengths):
  """Segment ids of rows packed with documents of these lengths (ids from 1)."""
  ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
  return jnp.asarray(np.tile(ids[:L], (B, 1)), jnp.int32)


@pytest.mark.parametrize('causal,K,segments,L,S', [
    (True, 2, False, 128, 128), (False, 4, False, 64, 192), (True, 1, True, 128, 128),
    (True, 2, False, 64, 256)])
def test_matches_the_reference_in_values_and_log_sum_exp(causal, K, segments, L, S):
  q, k, v, _ = inputs(L=L, S=S, K=K)
  q_seg = kv_seg = None
  if segments:  # documents crossing the key blocks of 64
    q_seg = kv_seg = packed(1, L, [40, 50, 38])
  o, lse = jax.jit(lambda q, k, v: flash_attention_hopper.forward(
      q, k, v, q_seg, kv_seg, causal=causal, scale=q.shape[-1] ** -0.5, block_k=64))(q, k, v)
  want_o, want_lse = reference(q, k, v, causal, q_seg, kv_seg)
  assert o.dtype == jnp.bfloat16 and lse.shape == (1, 4, L)
  np.testing.assert_allclose(np.asarray(o, np.float32), want_o, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse, want_lse, atol=2e-2, rtol=1e-3)


@pytest.mark.parametrize('H,block_k,stages', [(128, 128, 3), (256, 64, 2)])
def test_head_dims_128_and_256(H, block_k, stages):
  q, k, v, _ = inputs(L=64, S=256, N=2, K=1, H=H)
  o, lse = flash_attention_hopper.forward(q, k, v, causal=True, scale=H ** -0.5,
                                          block_k=block_k, stages=stages)
  want_o, want_lse = reference(q, k, v, True)
  np.testing.assert_allclose(np.asarray(o, np.float32), want_o, atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(lse, want_lse, atol=2e-2, rtol=1e-3)


def test_a_row_with_nothing_to_attend_to_gives_zeros_and_neg():
  q, k, v, _ = inputs(L=64, S=64, N=2, K=2)
  q_seg = jnp.asarray(np.r_[np.ones(32), np.full(32, 7)][None], jnp.int32)  # 7: no such key
  kv_seg = jnp.ones((1, 64), jnp.int32)
  o, lse = flash_attention_hopper.forward(q, k, v, q_seg, kv_seg, causal=False, scale=0.125,
                                          block_k=64)
  assert not np.asarray(o[:, 32:], np.float32).any()
  assert (lse[:, :, 32:] == flash_attention_hopper.NEG).all() and (lse[:, :, :32] > -1e3).all()


@pytest.mark.integration
@pytest.mark.parametrize('causal,K,segments,L,S', [
    (True, 2, True, 128, 128), (False, 4, False, 64, 192), (True, 1, False, 64, 256)])
def test_gradients_match_the_reference(causal, K, segments, L, S):
  """flash_attention(hopper=True): the Hopper forward, then its dq and dk/dv kernels."""
  q, k, v, do = inputs(L=L, S=S, K=K)
  seg = packed(1, L, [70, 58]) if segments else None

  def loss(attend):
    return lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * do).sum()
  ours = jax.jit(jax.grad(loss(lambda q, k, v: flash_attention(
      q, k, v, causal=causal, segment_ids_BL=seg, block_k=64, hopper=True)), (0, 1, 2)))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  want = jax.grad(loss(lambda q, k, v: xla_attention(q, k, v, causal=causal,
                                                     segment_ids_BL=seg)),
                  (0, 1, 2))(f32(q), f32(k), f32(v))
  for got, expected in zip(ours, want):
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.abs(expected).max())
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, expected / scale, atol=2e-2)


def over_two_devices(mode, causal, q, k, v, seg, do):
  """(o, dq, dk, dv) of Σ o·do by `mode`'s context parallelism over a sequence split of
  2 devices simulated by jax.vmap over the axis its collectives name. Not shard_map over CPU
  devices: Mosaic GPU's interpreter (jax 0.12) runs one kernel on several devices only in lock
  step, asserting each device's barriers freed before the others have finished theirs. Nor, as
  yet, the causal ring: vmap cannot batch its choice of visit (a `lax.switch` on the device
  index) over the interpreter's callbacks ("IO effect not supported in vmap-of-cond")."""
  n, (B, L) = 2, q.shape[:2]
  order = zigzag_order(L, n) if mode == 'ring' else np.arange(L)
  split = lambda x: jnp.moveaxis(x[:, order].reshape(B, n, L // n, *x.shape[2:]), 1, 0)
  fn = ring_attention if mode == 'ring' else gathered_attention

  def device(q, k, v, s, do):  # the gradient taken on each device, as in a train step
    def loss(q, k, v):
      o = fn(q, k, v, s, causal=causal, axis_name='sequence', block_q=64, block_k=64,
             hopper=True)
      return (o.astype(jnp.float32) * do).sum(), o
    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  (_, o), grads = jax.jit(jax.vmap(device, axis_name='sequence'))(
      *(split(x) for x in (q, k, v, seg, do)))
  merge = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, L, *x.shape[3:])[:, np.argsort(order)]
  return [merge(x) for x in (o, *grads)]


@pytest.mark.integration
@pytest.mark.parametrize('mode,causal', [('ring', False), ('all_gather', True)])
def test_context_parallel_attention_runs_on_them(mode, causal):
  """Over a sequence split of 2, values and gradients against unsharded attention: the ring's
  visits are parts in fp32 merged by their lse, and their gradients taken against the whole
  row's lse and delta; all_gather's queries sit at an offset known only at run time. (The causal
  ring's parts are the same kernels, causal or not: test_parts_and_offsets_match_triton's.)"""
  q, k, v, do = inputs(L=256, S=256, N=4, K=2)
  seg = packed(1, 256, [90, 100, 66])  # documents crossing the chunks of 64 and the devices
  f32 = lambda x: x.astype(jnp.float32)
  want = jax.value_and_grad(lambda q, k, v: (xla_attention(
      q, k, v, causal=causal, segment_ids_BL=seg) * do).sum(), (0, 1, 2))
  o = xla_attention(f32(q), f32(k), f32(v), causal=causal, segment_ids_BL=seg)
  ours = over_two_devices(mode, causal, q, k, v, seg, do)
  for name, got, expected in zip(('o', 'dq', 'dk', 'dv'), ours,
                                 (o, *want(f32(q), f32(k), f32(v))[1])):
    scale = float(jnp.abs(expected).max())
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, expected / scale, atol=2e-2,
                               err_msg=name)


@pytest.mark.integration
def test_parts_match_the_triton_kernels():
  """attention_parts and attention_parts_grads, as the causal ring's own visit runs them: o in
  fp32 and lse, then dq, dk, dv in fp32 against a given lse and delta, equal to the Triton
  kernels' (interpreted) within bf16's rounding of what is staged for the tensor cores."""
  q, k, v, do = inputs(L=128, S=128, N=4, K=2)
  seg = packed(1, 128, [70, 58])
  parts = lambda **kw: attention_parts(q, k, v, causal=True, segment_ids_BL=seg, block_k=64,
                                       **kw)
  o, lse = parts()
  delta = jnp.einsum('blnh,blnh->bnl', o, do)
  grads = lambda **kw: attention_parts_grads(q, k, v, o, lse, do, delta, causal=True,
                                             segment_ids_BL=seg, block_k=64, **kw)
  for got, want in zip((*parts(hopper=True), *grads(hopper=True)), (o, lse, *grads())):
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-2 * float(jnp.abs(want).max()))


@pytest.mark.parametrize('window,traced,segments', [
    (70, False, False), (130, True, True),
    *(pytest.param(*case, marks=pytest.mark.integration) for case in [(0, True, False),
                                                                      (64, True, False)])])
def test_a_sliding_window_matches_the_reference_values_and_gradients(window, traced, segments):
  """A local layer's window (fixed when compiled, or an int32 known at run time with 0 for a
  global layer) through the Hopper forward, dq and dk/dv: 70 and 130 keys cross the key blocks
  of 64, 64 is one block exactly, and packed documents cross both."""
  q, k, v, do = inputs(L=256, S=256, K=2)
  seg = packed(1, 256, [90, 100, 66]) if segments else None
  f32 = lambda x: x.astype(jnp.float32)

  def run(attend, *args):
    loss = lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * do).sum()
    return attend(*args), jax.grad(loss, (0, 1, 2))(*args)
  ours = jax.jit(lambda q, k, v: run(lambda q, k, v: flash_attention(
      q, k, v, causal=True, segment_ids_BL=seg, hopper=True,
      window=jnp.int32(window) if traced else window), q, k, v))(q, k, v)
  want = run(lambda q, k, v: xla_attention(q, k, v, causal=True, segment_ids_BL=seg,
                                           window=window or None), f32(q), f32(k), f32(v))
  for name, got, expected in zip(('o', 'dq', 'dk', 'dv'), (ours[0], *ours[1]),
                                 (want[0], *want[1])):
    assert got.dtype == jnp.bfloat16
    scale = float(jnp.abs(expected).max())
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, expected / scale, atol=2e-2,
                               err_msg=name)


def test_a_sliding_window_skips_the_key_blocks_outside_it_forward_and_backward():
  """Blocks of 64, a window of 5: key block 0 (keys 0–63) is outside the window of query blocks
  2 and 3 (rows 128–255), and query blocks 2 and 3 outside key block 0's. NaNs there reach no
  output the kernels skip them for, as they would through a loop over them (0 · NaN is NaN)."""
  q, k, v, do = inputs(L=256, S=256, N=2, K=1)

  def grads(q, v, rows):
    def loss(q, k, v):
      out = flash_attention(q, k, v, causal=True, window=jnp.int32(5), hopper=True,
                            block_k=64)
      return (out[:, rows].astype(jnp.float32) * do[:, rows]).sum(), out
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

  # the forward and dq of rows 128–191 never read key block 0
  (_, out), (dq, _, _) = grads(q, v.at[:, :64].set(jnp.nan), slice(128, 192))
  assert np.isnan(np.asarray(out[:, :64], np.float32)).all()
  assert np.isfinite(np.asarray(out[:, 128:], np.float32)).all()
  assert np.isfinite(np.asarray(dq[:, 128:192], np.float32)).all()
  # key block 0's dk and dv never read query blocks 2 and 3
  _, (_, dk, dv) = grads(q.at[:, 128:].set(jnp.nan), v, slice(0, 128))
  assert np.isfinite(np.asarray(dk[:, :64], np.float32)).all()
  assert np.isfinite(np.asarray(dv[:, :64], np.float32)).all()
  assert np.isnan(np.asarray(dk[:, 128:], np.float32)).all()  # which they do reach


@pytest.mark.parametrize('change,message', [
    (dict(dtype=jnp.float32), 'takes bfloat16 or float16'),
    (dict(H=96), 'head_dim=96: the Hopper kernel takes multiples of 64 up to 256'),
    (dict(L=100), 'L=100, S=128: pad them'),
    (dict(block_k=96), 'block_k=96: a multiple of 64'),
    (dict(H=256, block_k=128, stages=2), "over the H100's 227 KiB")])
def test_what_it_does_not_take_is_named_before_lowering(change, message):
  B, L, S, N, K, H = 1, change.get('L', 128), 128, 4, 2, change.get('H', 64)
  dtype = change.get('dtype', jnp.bfloat16)
  q = jax.ShapeDtypeStruct((B, L, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, H), dtype)
  with pytest.raises(ValueError, match=message):
    flash_attention_hopper.forward(q, kv, kv, causal=True, scale=1.0,
                                   block_k=change.get('block_k', 64), stages=change.get('stages'))


@pytest.mark.integration
@pytest.mark.parametrize('H,segments,window', [(64, False, None), (128, True, None),
                                               (256, False, None), (128, True, 1024)])
def test_forward_and_backward_lower_for_h100_as_three_mosaic_gpu_kernels(h100, H, segments,
                                                                         window):
  """Deviceless: the kernels lower through Mosaic GPU for sm_90a (their layouts, wgmma shapes
  and shared memory checked there) and XLA compiles the calls, forward, dq and dk/dv, for an
  H100 at the 8b model's heads (32 query, 8 key/value) and 4096 positions, and with Gemma 3's
  window of 1024 over packed rows. Mosaic GPU turns its
  module into PTX when the program is loaded on a GPU: registers and spills need one."""
  from planning import gpu_compiler
  place = jax.sharding.SingleDeviceSharding(h100)
  q = jax.ShapeDtypeStruct((1, 4096, 32, H), jnp.bfloat16, sharding=place)
  kv = jax.ShapeDtypeStruct((1, 4096, 8, H), jnp.bfloat16, sharding=place)
  ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=place)

  def loss(q, k, v, ids):
    o = flash_attention(q, k, v, causal=True, segment_ids_BL=ids if segments else None,
                        block_k=128 if H <= 128 else 64, interpret=False, hopper=True,
                        window=window)
    return o.astype(jnp.float32).sum()
  lowered = gpu_compiler.lower(h100, jax.jit(jax.grad(loss, (0, 1, 2))), q, kv, kv, ids)
  hlo = lowered.compile().as_text()
  assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 3
  assert 'flash_attention_dq' not in hlo and 'flash_attention_fwd' not in hlo  # no Triton
  # The time model charges the three as attention, at the prior planning/gpus.py holds for them
  charged = [k for k in timing.predict(hlo, gpus.GPUS['H100']).kernels
             if k.implementation == 'hopper']
  assert sorted(k.op.split('/')[0].rsplit('_', 1)[-1] for k in charged) == [
      'dkv', 'dq', 'fwd'] and all(k.part == 'attention' and k.seconds > 0 for k in charged)


@pytest.mark.integration
def test_the_time_model_charges_unmasked_kernels_under_grad_for_every_key(h100):
  """A non-causal call differentiated is named `jvp(unmasked)`: charged for all its keys, twice
  a causal one's forward FLOPs, ours in Triton as ours in Mosaic GPU."""
  place = jax.sharding.SingleDeviceSharding(h100)
  q = jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.bfloat16, sharding=place)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16, sharding=place)

  def forward_flops(causal, hopper):
    def loss(q, k, v):
      o = flash_attention(q, k, v, causal=causal, interpret=False, hopper=hopper, block_k=64)
      return o.astype(jnp.float32).sum()
    from planning import gpu_compiler
    hlo = gpu_compiler.lower(h100, jax.jit(jax.grad(loss, (0, 1, 2))), q, kv, kv).compile()
    [fwd] = [k for k in timing.predict(hlo.as_text(), gpus.GPUS['H100']).kernels
             if k.part == 'attention' and 'fwd' in k.op]
    return fwd.flops
  for hopper in (False, True):
    unmasked = forward_flops(False, hopper)
    assert unmasked == 4 * 1024 * 1024 * 8 * 64
    assert forward_flops(True, hopper) == pytest.approx(unmasked / 2, rel=1e-3)



@pytest.mark.integration
@pytest.mark.parametrize('window', [0, 100])
def test_a_ring_train_step_with_them_compiles_for_8_h100s(h100, window):
  """config.model.attention='hopper' over a sequence split of 4 (the ring, zigzag), deviceless
  for 8 H100s, with local and global layers too (a window of 100, each layer's at run time):
  every attention is one of the three Mosaic GPU kernels (none through Triton), the keys and
  values travel the ring, and the time model charges the kernels as attention."""
  from tests.conftest import tiny_config
  from training import settings
  from training.programs import compile_and_plan
  from training.state import build
  from sharding import collectives
  config = tiny_config(fsdp=2, sequence=4)
  config.seq_len = 1024  # chunks of 128 positions: whole blocks of the forward's keys
  config.model.update(head_dim=64, compute_dtype='bfloat16', attention='hopper',
                      context_parallel='ring')
  if window:
    config.model.update(sliding_window=window, global_every=2)
  config.plan.target, config.plan.devices, config.dry_run = 'H100', 8, True
  program, plan = compile_and_plan(build(settings.resolve(config)))
  hlo = program.as_text()
  assert 'mosaic_gpu_v2' in hlo and 'flash_attention_fwd' not in hlo
  assert any(c.op == 'collective-permute' for c in collectives.executed(hlo))
  charged = {k.op.split('/')[0].rsplit('_', 1)[-1] for k in timing.predict(
      hlo, gpus.GPUS['H100']).kernels if k.implementation == 'hopper'}
  assert charged == {'fwd', 'dq', 'dkv'}, charged
  assert plan.attention == 'hopper' and ('windowed_' in hlo) == bool(window)


@pytest.mark.integration
def test_a_one_h100_step_charges_them_inside_xlas_dynamic_slice_fusions(h100):
  """On one H100 the scanned layers' kernels reach their q, k, v through XLA's
  dynamic-slice fusions (an FFI call launched with its operands' slices): the time model charges
  the call inside as attention, forward and backward, never the fusion as elementwise work."""
  from tests.conftest import tiny_config
  from training import settings
  from training.programs import compile_and_plan
  from training.state import build
  config = tiny_config()
  config.seq_len = 256
  config.model.update(head_dim=64, compute_dtype='bfloat16', attention='hopper')
  config.plan.target, config.plan.devices, config.dry_run = 'H100', 1, True
  program, plan = compile_and_plan(build(settings.resolve(config)))
  hlo = program.as_text()
  assert 'kind=kCustom, calls=%dynamic-slice-fusion' in hlo
  charged = [k for k in timing.predict(hlo, gpus.GPUS['H100']).kernels if k.part == 'attention']
  assert sorted(k.op.split('/')[0].rsplit('_', 1)[-1] for k in charged) == ['dkv', 'dq', 'fwd']
  assert all(k.implementation == 'hopper' and k.seconds > 0 for k in charged)
  assert plan.time['breakdown']['attention']['s'] > 0
