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
    flash_attention_hopper.check(q, kv, kv, block_q=64, block_k=change.get('block_k', 64),
                                 stages=change.get('stages', 2))


@pytest.mark.parametrize('H,segments', [(64, False), (128, True), (256, False)])
def test_forward_and_backward_lower_for_h100_as_three_mosaic_gpu_kernels(h100, H, segments):
  """Deviceless: the kernels lower through Mosaic GPU for sm_90a (their layouts, wgmma shapes
  and shared memory checked there) and XLA compiles the calls, forward, dq and dk/dv, for an
  H100 at the 8b model's heads (32 query, 8 key/value) and 4096 positions. Mosaic GPU turns its
  module into PTX when the program is loaded on a GPU: registers and spills need one."""
  from planning import gpu_compiler
  place = jax.sharding.SingleDeviceSharding(h100)
  q = jax.ShapeDtypeStruct((1, 4096, 32, H), jnp.bfloat16, sharding=place)
  kv = jax.ShapeDtypeStruct((1, 4096, 8, H), jnp.bfloat16, sharding=place)
  ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=place)

  def loss(q, k, v, ids):
    o = flash_attention(q, k, v, causal=True, segment_ids_BL=ids if segments else None,
                        block_k=128 if H <= 128 else 64, interpret=False, hopper=True)
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

