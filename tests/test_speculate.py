"""Draft heads and speculative decoding (model/draft.py, inference/speculate.py): greedy speculation
gives plain greedy decoding's tokens, ragged batches and end-of-document included; sampled, every
token has the base model's distribution (a χ² test on a 4-token vocabulary); the heads learn
on the corpus without changing how the model trains, and train alone on a frozen base."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from inference import generate as gen
from inference.speculate import speculate
from model import ModelConfig, Transformer
from model.layers import Draft
from reporting.metrics import format_line
from runtime import checkpoint as checkpoint_lib
from tests.conftest import tiny_config
from training import loop
from training import settings
from training.state import build, initial_state

PROMPTS = [[1, 5, 3, 2, 7, 6], [1], [1, 4, 4]]


def drafting_model(vocab_size: int, **model):
  """A tiny model whose heads guess apart from the base (their output weights drawn, not zero),
  on a small vocabulary, so that guesses are kept and refused alike."""
  c = tiny_config()
  c.model.update(dict(vocab_size=vocab_size, **model))
  m = Transformer(ModelConfig.from_config(c.model), rngs=nnx.Rngs(3))
  m.draft.w_o[...] = 0.4 * jax.random.normal(jax.random.key(1), m.draft.w_o.shape)
  return m


@pytest.mark.integration
def test_greedy_speculation_gives_plain_greedy_tokens():
  """Clover heads (Medusa's decode in the sample.py test, tests/test_generate.py), an int8
  cache, ragged prompts."""
  model = drafting_model(8, draft_heads=3)
  plain = gen.generate(model, PROMPTS, 30, cache='int8')
  tokens, counts = speculate(model, PROMPTS, 30, cache='int8')
  np.testing.assert_array_equal(tokens, plain)
  assert counts['accepted'].sum() > 0  # guesses were kept: rounds committed several tokens
  assert (counts['tokens'] == 29).all() and (counts['forwards'] < 29).any()
  # A row ends at its end-of-document token, mid-round or not, as plain decoding's does: the
  # same tokens up to it, padding after.
  eos = int(plain[0, 9])
  ended = np.cumsum(np.cumsum(plain == eos, axis=1), axis=1) > 1  # past each row's first eos
  np.testing.assert_array_equal(speculate(model, PROMPTS, 30, eos_id=eos, pad_id=0,
                                          cache='int8')[0], np.where(ended, 0, plain))


def test_greedy_speculation_with_local_layers_gives_plain_greedy_tokens():
  """Local layers' rings (a window of 3) keep room for a round's guesses: the keys a refused
  guess's slot held stay until the next round, which writes over the guess; ragged prompts."""
  model = drafting_model(8, draft_heads=3, sliding_window=3, global_every=2, n_layers=3)
  plain = gen.generate(model, PROMPTS, 24)
  tokens, counts = speculate(model, PROMPTS, 24)
  np.testing.assert_array_equal(tokens, plain)
  assert counts['accepted'].sum() > 0 and (counts['forwards'] < 23).any()


@pytest.mark.integration
def test_greedy_rounds_keep_exactly_the_guesses_training_counts_as_hits():
  """The heads' hits as training counts them (the train step's forward: each head's guess at
  each position against the base's greedy token there, the true tokens before it), on the text
  greedy speculation writes, replay its rounds: a round from position p keeps the leading run of
  hits at p and moves on one token past it. Row by row the replay's rounds and kept guesses are
  speculation's, so a verification against another position or cache state, a head fed another
  token than in training, or another acceptance rule, shows here as a difference in counts."""
  model = drafting_model(8, draft_heads=3)
  # Heads near the base's own head: every head's guess is kept in some rounds, refused in others.
  model.draft.w_o[...] = 0.1 * jax.random.normal(jax.random.key(1), model.draft.w_o.shape)
  K, N = 3, 30
  plain = gen.generate(model, PROMPTS, N + K + 1)  # the text past N that the last round checks
  tokens, stats = speculate(model, PROMPTS, N)
  np.testing.assert_array_equal(tokens, plain[:, :N])
  texts = [p + list(row) for p, row in zip(PROMPTS, plain)]
  L = max(map(len, texts))
  text_BL = jnp.asarray([t + [0] * (L - len(t)) for t in texts], jnp.int32)
  # Trailing padding changes no earlier position's hidden state (the forward is causal).
  nll_KBL, gap_KBL = model.output(text_BL[:, :-1])[0].draft_losses(text_BL[:, 1:])
  hits_KBL = np.asarray(gap_KBL == 0)
  kept_BK = stats['accepted']
  assert (kept_BK[:, K - 1] > 0).any() and (kept_BK[:, 0] < stats['forwards']).all()
  for b, prompt in enumerate(PROMPTS):
    rounds, kept, count, p = 0, np.zeros(K, int), 1, len(prompt) - 1
    while count < N:
      a = next((k for k in range(K) if not hits_KBL[k, b, p]), K)
      rounds, kept[:a], count, p = rounds + 1, kept[:a] + 1, count + a + 1, p + a + 1
    assert stats['forwards'][b] == rounds
    np.testing.assert_array_equal(stats['accepted'][b], kept)


def test_heads_learn_the_base_models_greedy_token_not_the_texts():
  """A head's target at t is the base's own top token at t + k (what speculation checks its guess
  against), on any text. Heads with their output weights at zero are the base's head on h, so
  head k's guess at t is the base's top token at t, and training counts it a hit exactly where
  that token is also the base's top token at t + k + 1, whatever the text holds there."""
  model = drafting_model(8, draft_heads=2)
  model.draft.w_o[...] = jnp.zeros_like(model.draft.w_o[...])
  text_BL = jax.random.randint(jax.random.key(5), (4, 24), 0, 8)
  greedy_BL = np.asarray(jnp.argmax(model(text_BL[:, :-1]), axis=-1))
  nll_KBL, gap_KBL = model.output(text_BL[:, :-1])[0].draft_losses(text_BL[:, 1:])
  L = greedy_BL.shape[1]
  for k in range(2):
    hits_BT = np.asarray(gap_KBL[k, :, :L - k - 1] == 0)
    np.testing.assert_array_equal(hits_BT, greedy_BL[:, :L - k - 1] == greedy_BL[:, k + 1:])
    texts_BT = greedy_BL[:, :L - k - 2] == np.asarray(text_BL[:, k + 2:L])
    assert (hits_BT[:, :-1] != texts_BT).any()  # the text's tokens would count otherwise


@pytest.mark.integration
@pytest.mark.parametrize('top_k,top_p', [(3, 1.0), (0, 0.8)])
def test_sampled_tokens_have_the_base_models_distribution(top_k, top_p):
  """Three tokens after a prompt, drawn 20,000 times at temperature 0.7 among the top 3 of 4 (or
  the nucleus of 0.8):
  the heads guess tokens 2 and 3, and their counts over the 27 possible triples match the
  base model's own probabilities (χ², fixed seed). Accepting every guess, or drawing a refused
  one's replacement from the base's distribution instead of what is left of it over the head's,
  gives p < 1e-300 here."""
  model = drafting_model(4, draft_heads=2)
  temperature, rows, prompt = 0.7, 20_000, [1, 2]
  tokens, counts = speculate(model, [prompt] * rows, 3, key=jax.random.key(7),
                             temperature=temperature, top_k=top_k, top_p=top_p)
  kept = counts['accepted'].mean(0)
  assert 0.2 < kept[0] < 0.9 and 0.05 < kept[1] < kept[0]  # guesses both kept and refused
  prefixes = np.array([prompt + list(p) for p in itertools.product(range(4), repeat=2)])
  logits = model(jnp.asarray(prefixes, jnp.int32))[:, 1:]  # [16, 3, V]: the three draws
  probs = np.asarray(jax.nn.softmax(gen.tempered(logits.reshape(-1, 4),
                                                 gen.Sampling(temperature, top_k, top_p))),
                     np.float64).reshape(16, 3, 4)
  exact = np.zeros((4, 4, 4))
  for i, (a, b) in enumerate(itertools.product(range(4), repeat=2)):
    exact[a, b] = probs[i, 0, a] * probs[i, 1, b] * probs[i, 2]
  seen = np.zeros((4, 4, 4))
  np.add.at(seen, tuple(tokens.T), 1)
  possible = exact > 0
  assert (~possible).any() and seen[~possible].sum() == 0  # nothing outside the top 3 (nucleus)
  expected = exact[possible] / exact[possible].sum() * rows
  assert stats.chisquare(seen[possible], expected).pvalue > 1e-3


@pytest.mark.integration
def test_heads_learn_without_changing_the_model_and_train_alone_on_a_frozen_base(tmp_path):
  def run(name, steps, init_from='', **model):
    c = tiny_config(data=2)  # replicas run apart, summing the heads' counts too
    c.model.update(model)
    c.init_from = init_from
    c.workdir, c.train_steps, c.log_every = str(tmp_path / name), steps, 5
    c.eval_every, c.checkpoint_every = 0, steps
    c.optimizer.learning_rate = 3e-3
    return c, loop.run(c, jax.devices()[:2])

  _, plain = run('plain', 25)
  _, drafted = run('drafted', 25, draft_heads=2)
  # The model trains as it does without heads: the heads' gradients reach none of its weights,
  # and are clipped apart from its own.
  for a, b in zip(plain, drafted):
    assert a['loss'] == pytest.approx(b['loss'], rel=1e-6) and a['step'] == b['step']
    assert a['grad_norm'] == pytest.approx(b['grad_norm'], rel=1e-5)
  chance = 1 / 259  # the byte tokenizer's
  first, last = drafted[0], drafted[-1]
  for k in (1, 2):
    assert last[f'draft{k}_accuracy'] > max(20 * chance, first[f'draft{k}_accuracy'] + 0.05)
    assert last[f'draft{k}_loss'] < first[f'draft{k}_loss'] - 0.5
  assert f'draft top-1 {last["draft1_accuracy"]:.0%} / ' in format_line(last, 25)  # the console

  # Heads trained alone on that base, started from its checkpoint: the optimizer holds the heads
  # alone, and the base's parameters leave as they came.
  config, _ = run('alone', 5, draft_heads=2, draft_only=True, init_from=str(tmp_path / 'plain'))
  setup = build(settings.resolve(config, jax.devices()[:2]))
  moments = [a for a in jax.tree.leaves(setup.abstract_state.opt_state) if a.ndim >= 1]
  heads = [a for a in jax.tree.leaves(nnx.state(setup.abstract_state.params, Draft))]
  assert sum(a.size for a in moments) == 2 * sum(a.size for a in heads)  # Adam's mu and nu
  abstract = setup.abstract_state.params
  start, _ = checkpoint_lib.restore_params(str(tmp_path / 'plain'),
                                           nnx.state(abstract, nnx.Not(Draft)), config.model)
  end, _ = checkpoint_lib.restore_params(str(tmp_path / 'alone'), abstract, config.model)
  value = lambda v: np.asarray(v[...] if isinstance(v, nnx.Variable) else v)
  ends = dict(nnx.to_flat_state(end))
  for path, a in nnx.to_flat_state(start):
    np.testing.assert_array_equal(value(a), value(ends[path]))
  assert value(ends[('draft', 'w_o')]).any()  # the heads trained: their output weights left zero

  # A run started from the drafted one takes its heads where it trains the same ones, and says
  # it leaves them (and how to keep them) where it trains none.
  said = []
  for heads in (2, 0):
    config, _ = run(f'from-drafted-{heads}', 1, draft_heads=heads,
                    init_from=str(tmp_path / 'drafted'))
    setup = build(settings.resolve(config, jax.devices()[:2]))
    _, state, _ = initial_state(setup, None, said.append)
    if heads:
      saved, _ = checkpoint_lib.restore_params(str(tmp_path / 'drafted'),
                                               setup.checkpoint_state.params, config.model)
      for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(state.params, Draft)),
                                   nnx.to_flat_state(nnx.state(saved, Draft))):
        np.testing.assert_array_equal(value(a), value(b))
  assert said[0].endswith('; its 2 draft heads')
  assert said[1].endswith('its 2 draft heads left out, this run training none; to keep them: '
                          '--config.model.draft_heads=2 --config.model.draft_kind=clover')
