"""GRPO's objective (training/grpo.py) against the published formulas, computed directly in numpy
(float64) on the same fp32 inputs: GRPO's, DAPO's and Dr. GRPO's normalizations, symmetric and
DAPO's upper clip, with and without the KL term; its gradient likewise (each token's within 1e-5);
and with the sampling policy itself, the advantage-weighted log-likelihood's gradient. Rewards
(training/rewards.py) as the user's functions, and each way one fails named; rollouts
(inference/rollouts.py) as the sampler's completions in the step's rows; the compiled step under
GRPO's loss, sharded and microbatched as on one device."""

import itertools

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import pytest

from training import grpo

B, L = 6, 9


def batch(seed=0):
  rng = np.random.default_rng(seed)
  logps = -rng.uniform(0.1, 3.0, (B, L))
  old = logps + rng.normal(0, 0.3, (B, L))  # ratios both sides of every clip
  ref = logps + rng.normal(0, 0.5, (B, L))
  adv = rng.normal(0, 1, B)
  lengths = np.array([9, 1, 5, 3, 7, 2])
  mask = (np.arange(L)[None] < lengths[:, None]).astype(np.float64)
  # as fp32 holds them, so that the formula's float64 sees the same inputs
  return [x.astype(np.float32).astype(np.float64) for x in (logps, old, ref, adv, mask)]


def formula(logps, old, ref, adv, mask, lo, hi, beta, norm, cap):
  """(loss, d loss / d log π, Σ|the loss's terms|) of the published objective, float64."""
  a = adv[:, None]
  ratio = np.exp(logps - old)
  clipped = np.clip(ratio, 1 - lo, 1 + hi)
  unclipped = ratio * a <= clipped * a  # where min picks ρ·A, whose gradient is ρ·A
  gap = ref - logps
  per_token = -(np.minimum(ratio * a, clipped * a) - beta * (np.exp(gap) - gap - 1))
  d_token = -(np.where(unclipped, ratio * a, 0.0) - beta * (1 - np.exp(gap)))
  n = mask.sum(1)
  if norm == 'sequence':  # 1/G Σ_i 1/|o_i| Σ_t
    scale = np.broadcast_to(1 / (B * n[:, None]), (B, L))
  elif norm == 'token':  # 1/Σ|o_i| Σ_i Σ_t
    scale = np.full((B, L), 1 / n.sum())
  else:  # 1/(G · L_max) Σ_i Σ_t
    scale = np.full((B, L), 1 / (B * cap))
  terms = per_token * mask * scale
  return terms.sum(), d_token * mask * scale, np.abs(terms).sum()


@pytest.mark.parametrize('norm', sorted(grpo.NORMALIZATIONS))
def test_the_loss_and_its_gradient_are_the_formulas_for_every_clip_and_kl(norm):
  logps, old, ref, adv, mask = batch()
  for (lo, hi), beta in itertools.product(((0.2, None), (0.2, 0.28)), (0.0, 0.04)):
    def loss(lp, lo=lo, hi=hi, beta=beta):
      s = grpo.policy_sums(lp, jnp.asarray(old, jnp.float32), jnp.asarray(ref, jnp.float32),
                           jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32),
                           epsilon_low=lo, epsilon_high=hi, beta=beta, normalization=norm,
                           max_completion_length=12)
      return s['loss'] / s['weight'], s
    (value, sums), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logps, jnp.float32))
    want, want_grad, size = formula(logps, old, ref, adv, mask, lo, lo if hi is None else hi,
                                    beta, norm, 12)
    # within 1e-6 of the terms' size: the loss is a sum of terms of both signs, whose fp32
    # rounding is relative to them, not to what is left when they cancel
    np.testing.assert_allclose(value, want, rtol=0, atol=1e-6 * size)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7 * np.abs(want_grad).max())
    ratio = np.exp(logps - old)
    h = lo if hi is None else hi
    low = (ratio < 1 - lo) & (adv[:, None] < 0)
    high = (ratio > 1 + h) & (adv[:, None] > 0)
    assert 0 < sums['clipped_low'] and 0 < sums['clipped_high']
    assert (sums['clipped_low'], sums['clipped_high'], sums['clipped']) == (
        (low * mask).sum(), (high * mask).sum(), ((low | high) * mask).sum())
    gap = ref - logps
    np.testing.assert_allclose(sums['kl'], ((np.exp(gap) - gap - 1) * mask).sum() if beta else 0,
                               rtol=1e-5)
    assert sums['tokens'] == mask.sum() and sums['completions'] == B


def test_with_the_sampling_policy_the_ratio_is_one_and_the_gradient_the_likelihoods():
  """μ = 1: π_old is π itself, so ρ = 1 on every token, nothing is clipped, and with β = 0 the
  gradient is that of −1/G Σ_i A_i/|o_i| Σ_t log π (a linear softmax policy's weights)."""
  rng = np.random.default_rng(1)
  x_BLD = jnp.asarray(rng.normal(size=(B, L, 8)), jnp.float32)
  w_DV = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 16, (B, L)))
  _, _, _, adv, mask = batch()
  adv, mask = jnp.asarray(adv, jnp.float32), jnp.asarray(mask, jnp.float32)

  def logps(w):
    return jnp.take_along_axis(jax.nn.log_softmax(x_BLD @ w), targets[..., None], -1)[..., 0]

  def objective(w):
    lp = logps(w)
    s = grpo.policy_sums(lp, jax.lax.stop_gradient(lp), None, adv, mask)
    return s['loss'] / s['weight'], s

  def likelihood(w):
    return -(adv[:, None] * logps(w) * mask / mask.sum(1, keepdims=True)).sum() / B

  (_, sums), grad = jax.value_and_grad(objective, has_aux=True)(w_DV)
  np.testing.assert_allclose(grad, jax.grad(likelihood)(w_DV), rtol=1e-5, atol=1e-7)
  assert sums['ratio'] == sums['tokens'] == mask.sum() and sums['clipped'] == 0


def test_advantages_are_group_relative_as_trl_scales_them():
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 1.0, 0.5])
  r = np.asarray(rewards, np.float64).reshape(3, 4)
  centred = (r - r.mean(1, keepdims=True)).reshape(-1)
  np.testing.assert_allclose(grpo.advantages(rewards, 4), centred / (
      np.repeat(r.std(1, ddof=1), 4) + 1e-4), rtol=1e-6)
  np.testing.assert_allclose(grpo.advantages(rewards, 4, 'none'), centred, atol=1e-6)
  np.testing.assert_allclose(grpo.advantages(rewards, 4, 'batch'),
                             centred / (r.std(ddof=1) + 1e-4), rtol=1e-6)
  assert (grpo.advantages(rewards, 4)[4:8] == 0).all()  # a group of equal rewards teaches nothing
  m = grpo.group_metrics(rewards, 4)
  np.testing.assert_allclose(m['zero_std_groups'], 1 / 3)
  np.testing.assert_allclose(m['reward'], r.mean(), rtol=1e-6)
  np.testing.assert_allclose(m['reward_std'], r.std(1, ddof=1).mean(), rtol=1e-6)
  for bad in ((rewards, 1), (rewards, 5)):
    with pytest.raises(ValueError, match='groups of'):
      grpo.advantages(*bad)
  with pytest.raises(ValueError, match='normalization'):
    grpo.policy_sums(rewards[:, None], rewards[:, None], None, rewards, rewards[:, None],
                     normalization='mean')


# Reward functions as a user writes them (training/rewards.py loads them by module:function)
def exact_answer(prompts, completions, answer):
  return [float(c.strip() == a) for c, a in zip(completions, answer)]


def brevity(prompts, completions, **fields):
  assert set(fields) == {'answer', 'source'}, fields  # **kwargs: every field of the records
  return [-len(c) / 10 for c in completions]


def broken(prompts, completions):
  raise KeyError('scores')


def not_a_number(prompts, completions):
  return [float('nan')] * len(completions)


def too_few(prompts, completions):
  return [1.0]


def test_rewards_are_the_users_functions_weighted_and_each_ones_mean_kept():
  from training import rewards
  chosen = rewards.load(['tests.test_grpo:exact_answer', 'tests.test_grpo:brevity'], [1.0, 0.5])
  records = [{'answer': '4', 'source': 'a'}, {'answer': '9', 'source': 'b'}]
  rewards.check_fields(chosen, {'answer', 'source'})
  total, means = rewards.score(chosen, ['2+2?', '3*3?'], ['4', ' 10 '], records)
  np.testing.assert_allclose(total, [1 - 0.05, 0 - 0.2], rtol=1e-6)
  assert means == pytest.approx({'tests.test_grpo:exact_answer': 0.5,
                                 'tests.test_grpo:brevity': -0.25})


def test_a_reward_that_cannot_serve_stops_the_run_naming_it(tmp_path):
  from training import rewards
  two = (['2+2?', '3*3?'], ['4', '9'], [{'answer': '4'}, {'answer': '9'}])
  for spec, message in [('tests.test_grpo:broken', "raised KeyError: 'scores'"),
                        ('tests.test_grpo:not_a_number', r'returned nan for completion 0 \(and 1 '),
                        ('tests.test_grpo:too_few', 'returned 1 values for 2 completions')]:
    with pytest.raises(rewards.RewardError, match=f'reward {spec} {message}'):
      rewards.score(rewards.load([spec]), *two)
  for specs, message in [(['no_such_module:f'], "'no_such_module:f' cannot be imported"),
                         (['tests.test_grpo:nothing'], "has no function 'nothing'"),
                         (['exact_answer'], 'is not module:function'),
                         ([], 'names no reward'),
                         ([f'{tmp_path}/gone.py:f'], 'cannot be imported')]:
    with pytest.raises(rewards.RewardError, match=f'config.rl.rewards.*{message}'):
      rewards.load(specs)
  with pytest.raises(rewards.RewardError, match='2 rewards but 1 weights'):
    rewards.load(['tests.test_grpo:broken', 'tests.test_grpo:too_few'], [1.0])
  (tmp_path / 'mine.py').write_text('def length(prompts, completions, gold):\n'
                                    '  return [len(c) for c in completions]\n')
  chosen = rewards.load([f'{tmp_path}/mine.py:length'])
  with pytest.raises(rewards.RewardError, match=r"mine.py:length reads \['gold'\], which the "
                     r"records lack \(they hold \['answer'\]\)"):
    rewards.check_fields(chosen, {'answer'})
  assert rewards.score(chosen, ['p'], ['abc'], [{'gold': 'x'}])[0].tolist() == [3.0]


@pytest.mark.integration
def test_rollouts_are_the_samplers_completions_laid_out_as_the_steps_rows():
  """G completions a prompt, each the sampler's for the same key (cut after its EOS); each row's
  targets weighted exactly on its completion, EOS included; their log-probabilities those of a
  plain forward's softmax."""
  from inference import generate as gen
  from tests.test_generate import tiny_model
  from inference import rollouts
  model = tiny_model()
  prompts, key, G = [[1, 5, 9, 200], [1, 42]], jax.random.key(3), 3
  free = gen.generate(model, [p for p in prompts for _ in range(G)], 6, key=key, temperature=1.0,
                      vocab_size=300)
  eos = int(free[1, 2])  # a token row 1 draws third: its completion ends there
  out = rollouts.sample(model, prompts, G, 6, 12, sampling=gen.Sampling(1.0), key=key,
                        eos_id=eos, pad_id=0, vocab_size=300)
  for r, row in enumerate(free.tolist()):
    want = row[:row.index(eos) + 1] if eos in row else row
    assert out.completions[r] == want and out.prompts[r] == prompts[r // G]
  assert len(out.completions[1]) <= 3 and out.completions[1][-1] == eos
  assert len({tuple(c) for c in out.completions[:G]}) > 1  # a group's draws differ
  rows = out.rows
  for r, (p, c) in enumerate(zip(out.prompts, out.completions)):
    weighted = rows['weights'][r] == 1
    assert rows['targets'][r][weighted].tolist() == c and weighted.sum() == len(c)
    assert rows['inputs'][r][:len(p)].tolist() == p
    assert rows['segment_ids'][r].sum() == len(p) + len(c) - 1
  logps = rollouts.logps(model, rows)
  logits = model(jnp.asarray(rows['inputs']), jnp.asarray(rows['positions']),
                 jnp.asarray(rows['segment_ids']))
  direct = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                               jnp.asarray(rows['targets'])[..., None], -1)[..., 0]
  np.testing.assert_allclose(logps, np.where(rows['weights'] == 1, direct, 0.0), atol=2e-5)
  assert (logps[rows['weights'] == 0] == 0).all()
  with pytest.raises(ValueError, match='a group of 1 completions'):
    rollouts.sample(model, prompts, 1, 6, 12, sampling=gen.Sampling(), key=key, eos_id=eos,
                    pad_id=0)
  with pytest.raises(ValueError, match='need rows of 9, more than 8'):
    rollouts.sample(model, prompts, 2, 6, 8, sampling=gen.Sampling(), key=key, eos_id=eos,
                    pad_id=0)


def grpo_step(rows, microbatches=1, beta=0.0, **mesh):
  """One compiled train step of the tiny model under GRPO's loss (DAPO's clip and normalisation)
  on `rows`: (its metrics as logged, the updated parameters)."""
  from tests.conftest import tiny_config
  from training import grpo, programs, settings
  from training.state import build
  import sharding
  c = tiny_config(**mesh)
  c.optimizer.warmup_steps = 0
  setup = build(settings.resolve(c, jax.devices() if mesh else jax.devices()[:1]))
  loss = grpo.GRPO(epsilon_low=0.2, epsilon_high=0.28, beta=beta, normalization='token',
                   graphdef=setup.graphdef)
  B, L = rows['inputs'].shape
  step = programs.compile_train_step(setup, B, L, 0.0, microbatches=microbatches, loss=loss)
  placed = {k: jax.device_put(np.asarray(v, dtype), sharding.batch_sharding(setup.mesh))
            for k, v in rows.items()
            for dtype in [{**programs.BATCH_KEYS, **loss.batch_keys}[k]]}
  state, terms = step(setup.init_state(), placed)
  return ({k: float(v) for k, v in grpo.metrics(terms).items()},
          jax.tree.map(np.asarray, state.params))


@pytest.mark.integration
def test_grpos_step_over_fsdp_data_and_microbatches_equals_one_devices():
  """Rollouts of the tiny model scored, their advantages and π_old's log-probabilities in the
  rows: the compiled step's loss and KL are the objective's on them (ratio 1: π_old is the model
  that takes the step), and fsdp × data with 2 microbatches updates the parameters as one device
  does."""
  from inference import generate as gen
  from inference import rollouts
  from tests.conftest import tiny_config
  from training import settings
  from training.state import build
  c = tiny_config()
  setup = build(settings.resolve(c, jax.devices()[:1]))
  model = nnx.merge(setup.graphdef, setup.init_state().params)
  out = rollouts.sample(model, [[1, 5, 9, 200], [1, 42], [1, 7, 7], [1, 3]], 4, 8, c.seq_len,
                        sampling=gen.Sampling(1.0), key=jax.random.key(0), eos_id=10, pad_id=0,
                        vocab_size=300)
  rewards = jnp.asarray([len(x) % 3 for x in out.completions], jnp.float32)  # groups differ
  advantages = np.asarray(grpo.advantages(rewards, 4))
  old = rollouts.logps(model, out.rows)
  rows = {**out.rows, 'old_logps': old,
          'advantages': np.repeat(advantages[:, None], c.seq_len, 1)}
  one, params = grpo_step(rows)
  np.testing.assert_allclose(one['ratio'], 1.0, rtol=1e-5)
  assert one['kl'] == 0.0 and one['clip_ratio'] == 0.0
  mask = out.rows['weights']
  want = -(advantages[:, None] * mask).sum() / mask.sum()  # DAPO's per-token mean at ρ = 1
  np.testing.assert_allclose(one['loss'], want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(one['completion_length'], mask.sum() / len(mask), rtol=1e-6)
  sharded, sharded_params = grpo_step(rows, microbatches=2, fsdp=4, data=2)
  for key in ('loss', 'ratio', 'completion_length'):
    np.testing.assert_allclose(sharded[key], one[key], rtol=1e-5, atol=1e-7)
  for a, b in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(
      nnx.state(model, nnx.Param)))]
  assert any(moved)  # the advantages pushed the policy
  with pytest.raises(ValueError, match='a KL term .beta > 0. needs the reference model'):
    grpo_step(rows, beta=0.04)  # no reference in this state, no LoRA base to stand for it
