"""The head and loss as one chunked operation (model/head.py, kernels/cross_entropy.py): the plain
path's losses and gradients, on one device and sharded; the meshes' training curves, the
pipeline's and the ring's, run through it in tests/test_sharding.py and beside (tiny_config sets a
chunk that leaves the last one padded)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import head
from sharding import collectives
import sharding
from tests.conftest import f32_shapes, tiny_config
from training.programs import compile_train_step
from training import settings
from training.state import build

D, V = 16, 40


def inputs(tied: bool, B=3, L=10):
  """30 tokens by default: chunks of 7 leave the last with 2."""
  keys = jax.random.split(jax.random.key(0), 4)
  x_BLD = jax.random.normal(keys[0], (B, L, D), jnp.float32)
  w = jax.random.normal(keys[1], (V, D) if tied else (D, V), jnp.float32) * D ** -0.5
  targets_BL = jax.random.randint(keys[2], (B, L), 0, V)
  weights_BL = (jax.random.uniform(keys[3], (B, L)) < 0.7).astype(jnp.float32)  # ragged
  return x_BLD, w, targets_BL, weights_BL


def loss(chunk: int, tied: bool, rules=(), summed=False):
  """The weighted loss and z-loss from the head's per-token losses, or with `summed` from its
  sums (head.loss_sums, the train step's: the gradient made in the forward); `rules` active in
  the forward only, as training.step has them (the backward is traced after it returns)."""
  def total(x_BLD, w, targets_BL, weights_BL):
    total = jnp.maximum(weights_BL.sum(), 1.0)  # as training/step.py weighs them
    with nnx.logical_axis_rules(rules):
      if summed:
        value, nats, log_z2 = head.loss_sums(x_BLD, w, w.astype(x_BLD.dtype), targets_BL,
                                             weights_BL, tied=tied, chunk=chunk, z_loss=1e-2)
        return value / total, (nats / total, 1e-2 * log_z2 / total)
      nll_BL, logz_BL = head.token_losses(x_BLD, w, w.astype(x_BLD.dtype), targets_BL,
                                          tied=tied, chunk=chunk)
    ce = (nll_BL * weights_BL).sum() / total
    zl = 1e-2 * (jnp.square(logz_BL) * weights_BL).sum() / total
    return ce + zl, (ce, zl)
  return total


@pytest.mark.integration
@pytest.mark.parametrize('tied', [False, True])
def test_losses_and_gradients_equal_the_plain_paths(tied):
  """Per-token losses chunked (their backward recomputing the logits), and the loss's sums
  chunked (their gradient made in the forward) or plain: the plain path's loss and gradients."""
  x_BLD, w, targets_BL, weights_BL = inputs(tied)
  grads = {(chunk, summed): jax.value_and_grad(loss(chunk, tied, summed=summed), argnums=(0, 1),
                                               has_aux=True)(x_BLD, w, targets_BL, weights_BL)
           for chunk in (0, 7, 64) for summed in (False, True)}
  (plain_loss, (plain_ce, plain_zl)), plain_grads = grads[0, False]
  assert plain_zl > 0
  for key in [(0, True), (7, False), (64, False), (7, True), (64, True)]:  # ragged last chunk
    (value, (ce, zl)), (dx, dw) = grads[key]  # and one chunk larger than the tokens
    np.testing.assert_allclose([value, ce, zl], [plain_loss, plain_ce, plain_zl], rtol=1e-5)
    np.testing.assert_allclose(dx, plain_grads[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, plain_grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('summed', [False, True])
def test_sharded_over_tokens_and_vocabulary_equals_one_device(summed):
  """Tokens over data × fsdp and sequence, the vocabulary over tensor: the same losses and
  gradients, the weight's gradient landing in the parameter's own sharding; per-token losses,
  and the sums whose gradient the forward makes."""
  x_BLD, w, targets_BL, weights_BL = inputs(tied=False, B=2, L=14)  # 7 tokens a device
  expected = jax.value_and_grad(loss(5, tied=False), argnums=(0, 1), has_aux=True)(
      x_BLD, w, targets_BL, weights_BL)
  f = jax.value_and_grad(loss(5, False, sharding.ACTIVATION_RULES, summed=summed), argnums=(0, 1),
                         has_aux=True)
  mesh = sharding.make_mesh(tiny_config(fsdp=2, sequence=2, tensor=2).mesh)
  with jax.set_mesh(mesh):
    put = lambda a, names: jax.device_put(a, jax.NamedSharding(mesh, jax.P(*names)))
    args = (put(x_BLD, ('fsdp', 'sequence')), put(w, (('fsdp', 'sequence'), 'tensor')),
            put(targets_BL, ('fsdp', 'sequence')), put(weights_BL, ('fsdp', 'sequence')))
    got = jax.jit(f)(*args)
    hlo = jax.jit(f).lower(*args).compile().as_text()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, expected)
  assert got[1][1].sharding.spec == jax.P(('fsdp', 'sequence'), 'tensor')
  # Forward and backward each run on every device's own tokens: nothing but the weight (its
  # compute copy) is gathered, and its gradient is reduce-scattered.
  ops = collectives.executed(hlo)
  assert all(shape in {(D, V // 2), (D // 4, V // 2)} for c in ops if c.op == 'all-gather'
             for _, shape in c.arrays), [c for c in ops if c.op == 'all-gather']
  assert any(c.op == 'reduce-scatter' for c in ops)


@pytest.mark.parametrize('tied', [False, True])
def test_greedy_tokens_chunked_and_over_a_split_vocabulary_are_the_argmax(tied):
  """The head's top token at each position (the draft heads' targets), chunked on one device
  and with the vocabulary split over tensor: argmax's, the lowest id where a token's best logits
  tie across the vocabulary's shards."""
  x_BLD, w, _, _ = inputs(tied, B=2, L=14)
  w = w.at[(31, slice(None)) if tied else (slice(None), 31)].set(
      w[(3, slice(None)) if tied else (slice(None), 3)])  # ids 3 and 31 tie, in different shards
  logits = jnp.einsum('bld,vd->blv' if tied else 'bld,dv->blv', x_BLD, w)
  expected = np.asarray(jnp.argmax(logits, axis=-1))
  assert (expected == 3).any() and not (expected == 31).any()
  greedy = lambda chunk, rules=(): lambda x, w: _with_rules(rules, lambda: head.greedy_tokens(
      x, w, tied=tied, chunk=chunk))
  for chunk in (0, 5, 64):
    np.testing.assert_array_equal(greedy(chunk)(x_BLD, w), expected)
  mesh = sharding.make_mesh(tiny_config(fsdp=2, sequence=2, tensor=2).mesh)
  w_names = ('tensor', ('fsdp', 'sequence')) if tied else (('fsdp', 'sequence'), 'tensor')
  with jax.set_mesh(mesh):
    put = lambda a, names: jax.device_put(a, jax.NamedSharding(mesh, jax.P(*names)))
    got = jax.jit(greedy(5, sharding.ACTIVATION_RULES))(put(x_BLD, ('fsdp', 'sequence')),
                                                        put(w, w_names))
  np.testing.assert_array_equal(got, expected)


def _with_rules(rules, fn):
  with nnx.logical_axis_rules(rules):
    return fn()


def test_no_device_holds_more_than_a_chunk_of_logits():
  """The compiled train step of a model with a large vocabulary: every fp32 array with a
  vocabulary dimension is a chunk's, never the device's tokens'."""
  config = tiny_config(fsdp=8)
  config.model.vocab_size, config.model.head_chunk = 4096, 16  # 32 tokens a device: 2 chunks
  setup = build(settings.resolve(config))
  hlo = compile_train_step(setup, config.batch_size, config.seq_len, 0.0).as_text()
  # Arrays with a vocabulary dimension and no model dimension (the weight, its gradient and
  # moments have one): logits, probabilities, their gradients.
  logits = [s for s in f32_shapes(hlo) if 4096 in s and config.model.d_model not in s]
  tokens = config.batch_size * config.seq_len // 8
  assert logits and max(map(np.prod, logits)) <= 16 * 4096 < tokens * 4096, sorted(logits)[-3:]
