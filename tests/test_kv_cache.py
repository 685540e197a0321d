"""What decoding keeps of past tokens (model/kv_cache.py): int8 and int4 quantization against NumPy,
XQuant's X cache recomputing exactly the keys and values it replaces, quantized caches close to
the full one and the same for a row alone as in a ragged batch, a local layer's ring bounded by
its window and decoding what the whole sequence computes, and the bytes each kind is said to
take equal to the arrays it allocates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference import generate as gen
from inference import sampling
from model import ModelConfig, Transformer, kv_cache
from model.layers import Adapter
from tests.conftest import tiny_config

PROMPTS = [[1, 5, 9, 200, 7, 31, 64], [1], [1, 42, 42]]
# local, global, local, global, local: two whole groups of the scan and one layer after them
WINDOWED = dict(n_layers=5, sliding_window=3, global_every=2)


def tiny_model(**model):
  c = tiny_config()
  c.model.update(model)
  m = Transformer(ModelConfig.from_config(c.model), rngs=nnx.Rngs(3))
  for _, node in nnx.iter_graph(m):  # adapters that change the model (B starts at zero)
    if isinstance(node, Adapter):
      node.b[...] = 0.3 * jax.random.normal(jax.random.key(1), node.b[...].shape)
  return m


@pytest.mark.parametrize('bits', [8, 4])
def test_quantization_is_numpys(bits):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32) * rng.uniform(0.01, 30, (2, 5, 3, 1))
  x[0, 1, 2] = 0  # a group of zeros: scale 0, values 0
  x[1, 3, 0, 4] = 500  # an outlier sets its group's scale
  q, scale = jax.device_get(kv_cache.quantize(jnp.asarray(x), bits))
  qmax = 2 ** (bits - 1) - 1
  want_scale = (np.abs(x).max(-1) / qmax).astype(np.float16)
  safe = np.where(want_scale == 0, 1, want_scale).astype(np.float32)[..., None]
  want_q = np.clip(np.round(x / safe), -qmax, qmax).astype(np.int8)
  if bits == 4:  # two a byte, the even channel in the low nibble
    nibbles = want_q.astype(np.uint8) & 0xF
    want_q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
  np.testing.assert_array_equal(scale, want_scale)
  np.testing.assert_array_equal(q, want_q)
  back = np.asarray(kv_cache.dequantize(q, scale, jnp.float32))
  assert (np.abs(back - x) <= 0.5 * safe * 1.001 + 1e-6 * np.abs(x)).all()
  assert (back[0, 1, 2] == 0).all()


def _decoded(model, tokens, kind):
  """Logits of a prefill of 4 tokens, then one token at a time, against a cache of `kind`."""
  cache = model.init_cache(tokens.shape[0], tokens.shape[1] + 2, kind)
  logits, cache = model.decode(tokens[:, :4], jnp.broadcast_to(jnp.arange(4), (len(tokens), 4)),
                               cache)
  steps = [logits]
  for t in range(4, tokens.shape[1]):
    logits, cache = model.decode(tokens[:, t:t + 1], jnp.full((len(tokens), 1), t), cache)
    steps.append(logits)
  return np.concatenate(steps, axis=1)


# 2·K·H = D: X is cached itself; 2·K·H < D: its projection onto [Wk | Wv]'s left singular
# vectors, here with merged LoRA adapters and qk_norm's recomputed key norm.
@pytest.mark.integration
@pytest.mark.parametrize('model', [dict(n_kv_heads=2), dict(n_kv_heads=1, qk_norm=True,
                                                            lora_rank=2)],
                         ids=['X', 'latent'])
def test_the_x_cache_recomputes_the_keys_and_values_it_replaces(model):
  m = tiny_model(**model)
  cfg = m.cfg
  projected = 2 * cfg.n_kv_heads * cfg.head_dim < cfg.d_model
  cache = m.init_cache(2, 12, 'x')
  assert ('basis' in cache['weights']) == projected
  assert cache['x'].shape[-2:] == (kv_cache.x_width(cfg) // cfg.head_dim, cfg.head_dim)
  # One layer: keys and values from the stored latent equal X Wk and X Wv (adapters merged).
  x_BTD = jax.random.normal(jax.random.key(2), (2, 6, cfg.d_model))
  layer = jax.tree.map(lambda w: w[0], cache['weights'])
  k_BTKH, v_BTKH = kv_cache.recompute(kv_cache.latent(x_BTD, layer, kv_cache.x_group(cfg)), layer)
  graphdef, layers = nnx.split(m.blocks)
  wk, wv = jax.vmap(lambda s: nnx.merge(graphdef, s).attn.kv_weights())(layers)
  np.testing.assert_allclose(k_BTKH, jnp.einsum('btd,dkh->btkh', x_BTD, wk[0]), atol=2e-5)
  np.testing.assert_allclose(v_BTKH, jnp.einsum('btd,dkh->btkh', x_BTD, wv[0]), atol=2e-5)
  # The whole decode: the same logits as the K/V cache's.
  tokens = jnp.array([[1, 8, 20, 33, 2, 90, 17, 5], [1, 3, 3, 250, 7, 7, 60, 61]])
  np.testing.assert_allclose(_decoded(m, tokens, 'x'), _decoded(m, tokens, 'full'), atol=1e-4)


@pytest.mark.integration
def test_quantized_caches_decode_close_to_the_full_one():
  m = tiny_model(compute_dtype='bfloat16')
  tokens = jnp.array([[1, 8, 20, 33, 2, 90, 17, 5], [1, 3, 3, 250, 7, 7, 60, 61]])
  full = jax.nn.log_softmax(_decoded(m, tokens, 'full'))
  kl = {}
  for kind in kv_cache.QUANTIZED:  # the largest KL(full ‖ quantized) of any next token
    got = jax.nn.log_softmax(_decoded(m, tokens, kind))
    kl[kind] = float(jnp.max(jnp.sum(jnp.exp(full) * (full - got), axis=-1)))
  assert 0 < kl['int8'] < 1e-3 and 0 < kl['xquant'] < 1e-3, kl
  assert kl['int8'] < kl['int4'] < 5e-2 and kl['xquant'] < kl['xquant4'] < 5e-2, kl


@pytest.mark.integration
@pytest.mark.parametrize('kind', ['int4', 'xquant'])
def test_a_row_decodes_alone_as_in_a_ragged_batch(kind):
  m = tiny_model(compute_dtype='bfloat16')
  batch = gen.generate(m, PROMPTS, 8, cache=kind)
  for row, prompt in enumerate(PROMPTS):
    assert batch[row].tolist() == gen.generate(m, [prompt], 8, cache=kind)[0].tolist()


@pytest.mark.parametrize('model', [dict(), dict(n_kv_heads=1, compute_dtype='bfloat16'),
                                   WINDOWED])
def test_each_kinds_bytes_are_the_arrays_it_allocates(model):
  m = tiny_model(**model)
  cfg = m.cfg
  B, S = 3, 10
  for kind in kv_cache.KINDS:
    cache = m.init_cache(B, S, kind)
    weights = cache.pop('weights', {})
    stored = sum(a.nbytes for a in jax.tree.leaves(cache))
    assert stored == kv_cache.stored_bytes(cfg, kind, B, S), kind
    if not cfg.sliding_window:
      assert stored == kv_cache.bytes_per_token(cfg, kind) * cfg.n_layers * B * S, kind
    else:  # three local layers' rings of 3 slots (and their positions), two global layers' 10
      assert stored == B * (2 * S + 3 * 3) * kv_cache.bytes_per_token(cfg, kind) + 4 * 3 * B * 3
    assert sum(a.nbytes for a in jax.tree.leaves(weights)) == kv_cache.fixed_bytes(cfg, kind)
    assert sampling.cache_bytes(cfg, kind, B, S) == 2 * stored + kv_cache.fixed_bytes(cfg, kind)
  H, K = cfg.head_dim, cfg.n_kv_heads
  assert kv_cache.bytes_per_token(cfg, 'int8') == 2 * K * (H + 2)  # int8 values, fp16 scales
  assert kv_cache.bytes_per_token(cfg, 'int4') == 2 * K * (H // 2 + 2)
  assert kv_cache.bytes_per_token(cfg, 'full') == 2 * K * H * cfg.dtype.itemsize
  with pytest.raises(ValueError, match='--kv_cache'):
    sampling.check_arguments(10, 0.0, 0, 0, 'int2')


@pytest.mark.parametrize('kind', ['full', pytest.param('x', marks=pytest.mark.integration)])
def test_a_local_layers_ring_holds_its_window_and_decodes_what_the_whole_sequence_computes(kind):
  """A window of 3 keys over 20 positions: each local layer's cache is a ring of 3 slots,
  written over six times; a prefill of 4 tokens (more than the ring holds) and then one token at
  a time give the logits of the forward over the whole sequence (fp32), and an X cache's ring
  the K/V cache's."""
  m = tiny_model(**WINDOWED)
  tokens = jax.random.randint(jax.random.key(5), (2, 20), 1, m.cfg.vocab_size)
  cache = m.init_cache(2, 22, kind)
  ring = 'k_local' if kind == 'full' else 'x_local'
  assert kv_cache.leaf_shape(cache[ring])[:3] == (3, 2, 3)  # [local layers, B, window]
  assert kv_cache.leaf_shape(cache[ring.replace('_local', '')])[:3] == (2, 2, 22)
  assert (cache['positions_local'] == -1).all()
  decoded = _decoded(m, tokens, kind)
  np.testing.assert_allclose(decoded, m(tokens), atol=1e-4 if kind == 'x' else 2e-5)


def test_a_row_decodes_alone_as_in_a_ragged_batch_with_local_layers():
  """Pads (position −1) are kept by no ring: the short rows' newest keys stay within reach."""
  m = tiny_model(**WINDOWED)
  batch = gen.generate(m, PROMPTS, 10)
  for row, prompt in enumerate(PROMPTS):
    assert batch[row].tolist() == gen.generate(m, [prompt], 10)[0].tolist()


def test_a_ring_writes_each_slot_once_a_call_newest_first_and_no_pad():
  """Six positions into a ring of 4: the first two would share slots with the last two (a
  scatter's order among equal indices is not defined), so only the newest 4 are written; pads
  (−1) nowhere (slot 4, out of bounds, is dropped)."""
  positions = jnp.array([[0, 1, 2, 3, 4, 5], [0, 1, -1, -1, -1, -1], [7, 8, 9, 10, 11, 12]])
  np.testing.assert_array_equal(kv_cache.slots_of(positions, 4, ring=True),
                                [[4, 4, 2, 3, 0, 1], [0, 1, 4, 4, 4, 4], [4, 4, 1, 2, 3, 0]])
  np.testing.assert_array_equal(kv_cache.slots_of(positions[1:2], 22, ring=False),
                                [[0, 1, 22, 22, 22, 22]])
