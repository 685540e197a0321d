"""Context parallelism (kernels/context_parallel.py): ring and all-gathered attention over a
sequence split equal unsharded attention, values and gradients; zigzag gives every device the
same work; a train step over a sequence split equals one device's, and moves what it should."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from kernels import context_parallel
from kernels import gathered_attention, ring_attention, xla_attention, zigzag_order
from sharding import collectives
import sharding
from tests.conftest import tiny_config
from tests.test_kernels import random_batch
from training import programs
from training import settings
from training.state import build

CHUNK = 16  # rows per device, one kernel block: the smallest that tests every path


def sequence_mesh(n):
  return jax.make_mesh((n,), ('sequence',), devices=jax.devices()[:n], axis_types=(AxisType.Auto,))


def problem(n, kv_heads, packed, B=2, N=4, H=16):
  """q, k, v, a cotangent and segment ids for a row of n·CHUNK tokens. Packed: row 0 holds three
  documents whose boundaries fall inside chunks (zigzag's too), row 1 one document and padding."""
  L = n * CHUNK
  ks = jax.random.split(jax.random.key(n), 4)
  q = jax.random.normal(ks[0], (B, L, N, H))
  k, v = (jax.random.normal(key, (B, L, kv_heads, H)) for key in ks[1:3])
  seg = None
  if packed:
    s = np.zeros((B, L), np.int32)
    s[0, :L // 3], s[0, L // 3:L - 3], s[0, L - 3:] = 1, 2, 3
    s[1, :L // 2 + 5] = 1
    seg = jnp.asarray(s)
  return q, k, v, jax.random.normal(ks[3], q.shape), seg


def sharded(mode, n, q, k, v, seg, cotangent, causal, window=None):
  """(out, dq, dk, dv) of Σ out·cotangent, computed over a sequence split of n devices and put
  back in the plain order. `window`: an int, fixed in the program, or a jax scalar, its input."""
  L = q.shape[1]
  order = zigzag_order(L, n) if mode == 'ring' else np.arange(L)
  fn = ring_attention if mode == 'ring' else gathered_attention
  spec = P(None, 'sequence')
  traced = window is not None and not isinstance(window, int)
  # a window known at run time comes with the local layers' size (the model's sliding_window),
  # which a global layer's 0 does not change
  mix = dict(window_mix=(int(window) or 5, 0.5)) if traced else {}
  attend = jax.shard_map(
      lambda q, k, v, s, w: fn(q, k, v, s, causal=causal, axis_name='sequence', block_q=CHUNK,
                               block_k=CHUNK, window=w if traced else window, **mix),
      mesh=sequence_mesh(n), in_specs=(spec, spec, spec, None if seg is None else spec, P()),
      out_specs=spec, check_vma=False)

  def loss(q, k, v):
    out = attend(q, k, v, None if seg is None else seg[:, order],
                 window if traced else jnp.int32(0))
    return (out * cotangent[:, order]).sum(), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
      q[:, order], k[:, order], v[:, order])
  inverse = np.argsort(order)
  return [x[:, inverse] for x in (out, *grads)]


@pytest.mark.integration
def test_a_window_within_the_neighbours_chunks_sends_their_keys_alone():
  """Over 8 devices a window of 6 (chunks of 8 rows) needs only each neighbour's keys: they come
  a hop each way (the backward's resend is the forward's, one program), and their dK, dV go
  home, 4 collective-permutes run in all (sharding/collectives.py counts them); a window of 20
  runs the whole ring's, 3 times as many or more."""
  n = 8
  q, k, v, cotangent, seg = problem(n, 2, packed=True)
  order = zigzag_order(q.shape[1], n)
  spec = P(None, 'sequence')

  def permutes(window):
    attend = jax.shard_map(
        lambda q, k, v, s: ring_attention(q, k, v, s, causal=True, axis_name='sequence',
                                          block_q=CHUNK, block_k=CHUNK, window=window),
        mesh=sequence_mesh(n), in_specs=(spec,) * 4, out_specs=spec, check_vma=False)
    loss = lambda q, k, v: (attend(q, k, v, seg[:, order]) * cotangent[:, order]).sum()
    hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().as_text()
    return sum(c.executions for c in collectives.executed(hlo) if c.op == 'collective-permute')
  near, whole = permutes(6), permutes(20)
  assert near == 4 and whole >= 3 * near, (near, whole)


def unsharded(q, k, v, seg, cotangent, causal, window=None):
  def loss(q, k, v):
    out = xla_attention(q, k, v, causal=causal, segment_ids_BL=seg, window=window)
    return (out * cotangent).sum(), out
  (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
  return [out, *grads]


@pytest.mark.integration
@pytest.mark.parametrize('mode,n,causal,kv_heads,packed,window', [
    ('ring', 2, True, 2, True, None), ('ring', 8, True, 1, True, None),
    ('ring', 4, False, 2, True, None), ('ring', 4, True, 4, False, None),
    ('all_gather', 2, True, 2, True, None), ('all_gather', 8, True, 1, True, None),
    ('all_gather', 4, False, 4, False, None),
    # sliding windows: shorter than a zigzag chunk (8 rows), across several, in the program or
    # its input (0: a global layer's); over 4 and 8 devices a window of 5 or 6 takes its
    # neighbours' keys alone (a hop each way), of 12 or 20 the whole ring
    ('ring', 4, True, 2, True, 5), ('ring', 2, True, 1, False, 20),
    ('ring', 4, True, 2, False, np.int32(12)), ('ring', 2, True, 2, True, np.int32(0)),
    ('ring', 8, True, 2, False, 6), ('ring', 8, True, 1, True, np.int32(5)),
    ('ring', 8, True, 2, True, np.int32(0))])
def test_equals_unsharded_attention_values_and_gradients(mode, n, causal, kv_heads, packed,
                                                         window):
  """GQA (kv_heads < 4 query heads) without copying K/V; documents crossing chunk boundaries."""
  q, k, v, cotangent, seg = problem(n, kv_heads, packed)
  ours = sharded(mode, n, q, k, v, seg, cotangent, causal, window)
  for name, a, b in zip(('out', 'dq', 'dk', 'dv'), ours, unsharded(q, k, v, seg, cotangent,
                                                                    causal, window)):
    assert a.shape == b.shape, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * max(1, np.abs(b).max()),
                               err_msg=name)


def test_zigzag_gives_every_device_the_same_attention_work(monkeypatch):
  """Each kernel call each device runs, counted as it runs (a callback inside the ring's branch
  that ran): every device visits the same number of query×key blocks, and together they visit
  the blocks causal attention needs, each once."""
  n = 4
  calls = []
  real = context_parallel.attention_parts

  def counted(q, k, v, *, causal, **kwargs):
    blocks = (q.shape[1] // (CHUNK // 2), k.shape[1] // (CHUNK // 2))
    jax.debug.callback(lambda r: calls.append((int(r), blocks, causal)),
                       jax.lax.axis_index('sequence'))
    return real(q, k, v, causal=causal, **kwargs)

  monkeypatch.setattr(context_parallel, 'attention_parts', counted)
  q, k, v, _, seg = problem(n, 2, packed=True)
  spec = P(None, 'sequence')
  attend = jax.shard_map(
      functools.partial(ring_attention, causal=True, axis_name='sequence', block_q=CHUNK // 2,
                        block_k=CHUNK // 2),
      mesh=sequence_mesh(n), in_specs=(spec, spec, spec, spec), out_specs=spec, check_vma=False)
  jax.block_until_ready(jax.jit(attend)(q, k, v, seg))
  jax.effects_barrier()

  def work(blocks, causal):  # chunk pairs of CHUNK/2 rows: what the kernel visits
    (bq, bk) = blocks
    return bq * (bq + 1) // 2 if causal else bq * bk

  per_device = [sum(work(b, c) for r, b, c in calls if r == device) for device in range(n)]
  assert len(calls) == n * n  # each device: its own keys, then n − 1 visitors
  assert len(set(per_device)) == 1, per_device
  chunks = 2 * n  # the causal triangle of 2n × 2n chunk pairs
  assert sum(per_device) == chunks * (chunks + 1) // 2, per_device


# Gemma 3's shape of model (configs/gemma3.py's COMMON): a local layer of window 3, whose keys
# cross zigzag's chunks of 8 rows at their edges, then a global one, each taking its window at
# run time
GEMMA = (('sliding_window', 3), ('global_every', 2), ('qk_norm', True), ('norm_plus_one', True),
         ('post_norms', True), ('embed_scale', True), ('mlp_activation', 'gelu_tanh'),
         ('rope_local_theta', 1e4))


@functools.cache
def compiled_step(implementation='pallas', context_parallel='all_gather', model=(), **mesh):
  config = tiny_config(**mesh)
  config.model.attention, config.model.context_parallel = implementation, context_parallel
  config.model.update(dict(model))
  devices = jax.devices() if mesh else jax.devices()[:1]
  setup = build(settings.resolve(config, devices))
  return setup, config, programs.compile_train_step(setup, config.batch_size, config.seq_len, 0.0)


def train_once(*args, **mesh):
  setup, config, step = compiled_step(*args, **mesh)
  state, metrics = step(setup.init_state(), random_batch(setup, config))
  return (float(metrics['loss']), float(metrics['grad_norm']),
          jax.tree.map(np.asarray, state.params), step.as_text())


@functools.cache
def one_device(model=()):
  """The reference step, XLA's attention on one device (the cases below compare with it)."""
  return train_once('xla', model=model)


def long_documents(setup, config):
  """Rows of two documents, 20 and 12 tokens: longer than the window and than zigzag's chunks."""
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  lengths = (20, config.seq_len - 20)
  host = {'inputs': rng.integers(0, 256, shape), 'targets': rng.integers(0, 256, shape),
          'segment_ids': np.repeat([1, 2], lengths)[None].repeat(shape[0], 0),
          'positions': np.concatenate([np.arange(n) for n in lengths])[None].repeat(shape[0], 0),
          'weights': np.ones(shape)}
  s = sharding.batch_sharding(setup.mesh)
  return {k: jax.device_put(np.asarray(v, programs.BATCH_KEYS[k]), s) for k, v in host.items()}


def gemma_step(implementation, context_parallel='all_gather', model=GEMMA, **mesh):
  setup, config, step = compiled_step(implementation, context_parallel, model, **mesh)
  state, metrics = step(setup.init_state(), long_documents(setup, config))
  return float(metrics['loss']), float(metrics['grad_norm']), jax.tree.map(np.asarray,
                                                                          state.params)


@pytest.mark.integration
def test_gemmas_local_and_global_layers_over_a_ring_equal_one_device():
  """fsdp × tensor × sequence (ring): the local layer's window reaches across zigzag's chunks and
  the devices; loss, gradient norm and updated parameters as one device's XLA attention."""
  loss, grad_norm, params = gemma_step('xla')
  ours_loss, ours_norm, ours_params = gemma_step('pallas', 'ring', fsdp=2, tensor=2, sequence=2)
  np.testing.assert_allclose(ours_loss, loss, rtol=1e-5)
  np.testing.assert_allclose(ours_norm, grad_norm, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(ours_params), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # the window changes the step beyond those tolerances: the comparison sees it
  unwindowed = gemma_step('xla', model=tuple(kv for kv in GEMMA if kv[0] != 'sliding_window'
                                             and kv[0] != 'global_every'))
  assert abs(unwindowed[1] - grad_norm) > 1e-3 * grad_norm, (unwindowed[1], grad_norm)


@pytest.mark.integration
@pytest.mark.parametrize('context_parallel,mesh', [('ring', dict(fsdp=2, sequence=4)),
                                                  ('all_gather', dict(tensor=2, sequence=4))])
def test_a_train_step_over_sequence_4_equals_one_device(context_parallel, mesh):
  """Rows (fsdp) or heads (tensor) split too, packed rows whose documents cross the chunks,
  against one device running XLA's attention; and the compiled program moves keys and values as
  it should: the ring by collective-permutes (one buffer a hop: keys, values and segment ids of
  a chunk), never all-gathering them; all_gather gathers them, never the queries."""
  loss, grad_norm, params, _ = one_device()
  ours_loss, ours_norm, ours_params, hlo = train_once('pallas', context_parallel, **mesh)
  np.testing.assert_allclose(ours_loss, loss, rtol=1e-5)
  np.testing.assert_allclose(ours_norm, grad_norm, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(ours_params), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

  config, t = tiny_config(), mesh.get('tensor', 1)
  b, L = config.batch_size // mesh.get('fsdp', 1), config.seq_len  # rows per device
  kv = (b, L, config.model.n_kv_heads // t, config.model.head_dim)
  q = (b, L, config.model.n_heads // t, config.model.head_dim)
  gathered = set(collectives.shapes(hlo, 'all-gather'))
  permuted = set(collectives.shapes(hlo, 'collective-permute'))
  if context_parallel == 'ring':
    chunk = b * (L // 4)  # this device's tokens
    words = 2 * chunk * kv[2] * kv[3] + chunk  # k and v in fp32, and int32 segment ids
    assert kv not in gathered and (words,) in permuted, (gathered, permuted)
  else:
    assert kv in gathered and q not in gathered, gathered


def test_ring_needs_our_kernel_and_two_chunks_a_device():
  config = tiny_config(fsdp=2, sequence=4)
  config.model.attention, config.model.context_parallel = 'xla', 'ring'  # auto would take ours
  with pytest.raises(ValueError, match="context_parallel='ring'.*attention=pallas"):
    build(settings.resolve(config))
  config.model.attention, config.seq_len = 'pallas', 36
  with pytest.raises(sharding.MeshMismatch, match='config.seq_len=36 is not divisible by '
                     '2×config.mesh.sequence=8'):
    build(settings.resolve(config))
