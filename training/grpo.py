"""GRPO's objective (Shao et al. 2024) and the variants users choose between, DAPO's (Yu et al.
2025) and Dr. GRPO's (Liu et al. 2025), on completions sampled G to a prompt: the terms TRL's
GRPOTrainer computes, as sums over a batch's tokens so that microbatches add theirs.

Each completion i of a group is scored (rewards R), and every one of its tokens t gets

  ρ = exp(log π − log π_old)            the ratio to the policy that sampled it
  l = min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) − β·KL
  KL = exp(log π_ref − log π) − (log π_ref − log π) − 1      (k3: ≥ 0, unbiased for KL(π‖π_ref))

with A the completion's group-relative advantage (`advantages`), and the loss is −l averaged by the
normalisation chosen (NORMALIZATIONS). With one update per rollout batch π_old = π (ρ = 1, its
value; its gradient is ∇log π) and the gradient is the advantage-weighted log-likelihood's.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from training import dpo

# How the per-token terms are averaged into the loss:
NORMALIZATIONS = {
    'sequence': "each completion's mean over its tokens, then the mean over completions (GRPO)",
    'token': 'the mean over every completion token of the batch, long ones weighing more (DAPO)',
    'constant': 'the sum over tokens ÷ (completions × the length cap): no length bias (Dr. GRPO)',
}
# TRL's guard against a group whose rewards are all equal (its std is 0)
STD_EPS = 1e-4


def advantages(rewards_B, group: int, scale: str = 'group'):
  """Each completion's reward less its group's mean (rows i·G … i·G + G − 1 are a prompt's G
  completions), divided by the group's standard deviation (`scale='group'`, GRPO's; ddof 1, as
  torch's std in TRL), the batch's (`'batch'`), or by nothing (`'none'`, Dr. GRPO's); fp32 [B]."""
  if rewards_B.shape[0] % group or group < 2:
    raise ValueError(f'advantages: {rewards_B.shape[0]} rewards are not groups of {group} ≥ 2')
  r_GB = rewards_B.astype(jnp.float32).reshape(-1, group)
  centred = (r_GB - r_GB.mean(1, keepdims=True)).reshape(-1)
  if scale == 'none':
    return centred
  if scale == 'group':
    std = jnp.repeat(r_GB.std(1, ddof=1), group)
  elif scale == 'batch':
    std = rewards_B.astype(jnp.float32).std(ddof=1)
  else:
    raise ValueError(f"advantages: scale={scale!r} is not 'group', 'batch' or 'none'")
  return centred / (std + STD_EPS)


def policy_sums(logps_BL, old_logps_BL, ref_logps_BL, advantages_B, mask_BL, *,
                epsilon_low: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                normalization: str = 'sequence', max_completion_length: int = 0) -> dict:
  """The objective's sums over a batch (module docstring), fp32: 'loss' the normalised sum of −l
  (divide by 'weight'), and for the metrics, over completion tokens (divide by 'tokens'): the KL,
  the ratio, the tokens clipped below, above and either way. log π_old and log π_ref carry no
  gradient; `ref_logps_BL` may be None where β = 0. `mask_BL`: 1 on completion tokens.
  epsilon_high: DAPO's upper clip (default ε_low, GRPO's symmetric one). 'weight' is, per
  normalisation, the completions ('sequence': each adds its mean), the tokens ('token'), or
  completions × `max_completion_length` ('constant'): each a sum too, so microbatches and data
  replicas add theirs and the loss is sum ÷ weight over the whole batch."""
  if normalization not in NORMALIZATIONS:
    raise ValueError(f'policy_sums: normalization={normalization!r} is not one of '
                     f'{sorted(NORMALIZATIONS)}')
  if normalization == 'constant' and max_completion_length < 1:
    raise ValueError('policy_sums: the constant normalization needs max_completion_length ≥ 1')
  high = epsilon_low if epsilon_high is None else epsilon_high
  mask_BL = mask_BL.astype(jnp.float32)
  logps_BL = logps_BL.astype(jnp.float32)
  old_BL = jax.lax.stop_gradient(old_logps_BL.astype(jnp.float32))
  a_B1 = jax.lax.stop_gradient(advantages_B.astype(jnp.float32))[:, None]
  ratio_BL = jnp.exp(logps_BL - old_BL)
  clipped_BL = jnp.clip(ratio_BL, 1 - epsilon_low, 1 + high)
  objective_BL = jnp.minimum(ratio_BL * a_B1, clipped_BL * a_B1)
  kl_BL = jnp.zeros_like(logps_BL)
  if beta:
    gap_BL = jax.lax.stop_gradient(ref_logps_BL.astype(jnp.float32)) - logps_BL
    kl_BL = jnp.exp(gap_BL) - gap_BL - 1
  token_loss_BL = -(objective_BL - beta * kl_BL) * mask_BL
  lengths_B = mask_BL.sum(1)
  completions = (lengths_B > 0).astype(jnp.float32)
  if normalization == 'sequence':
    loss = (token_loss_BL.sum(1) / jnp.maximum(lengths_B, 1.0)).sum()
    weight = completions.sum()
  else:
    loss = token_loss_BL.sum()
    weight = (lengths_B.sum() if normalization == 'token'
              else completions.sum() * max_completion_length)
  low_BL = (ratio_BL < 1 - epsilon_low) & (a_B1 < 0)
  high_BL = (ratio_BL > 1 + high) & (a_B1 > 0)
  counted = lambda x_BL: jax.lax.stop_gradient((x_BL * mask_BL).sum())
  return {'loss': loss, 'weight': jax.lax.stop_gradient(weight), 'kl': counted(kl_BL),
          'ratio': counted(ratio_BL), 'clipped_low': counted(low_BL),
          'clipped_high': counted(high_BL), 'clipped': counted(low_BL | high_BL),
          'tokens': jax.lax.stop_gradient(lengths_B.sum()),
          'completions': jax.lax.stop_gradient(completions.sum())}


def group_metrics(rewards_B, group: int) -> dict:
  """What TRL users watch of a batch's rewards: their mean, the mean of the groups' standard
  deviations, and the share of groups whose rewards are all equal (no advantage, no gradient)."""
  r_GB = rewards_B.astype(jnp.float32).reshape(-1, group)
  std_G = r_GB.std(1, ddof=1)
  return {'reward': r_GB.mean(), 'reward_std': std_G.mean(),
          'zero_std_groups': jnp.isclose(std_G, 0.0, rtol=0.0, atol=1e-8).mean()}  # TRL's test


@dataclasses.dataclass(frozen=True)
class GRPO:
  """The objective as the train step's loss (training/step.py: LanguageModel's signature) on
  rollouts' rows (inference/rollouts.py) carrying each row's advantage ('advantages', its value
  at every position) and π_old's log-probabilities ('old_logps'); with β > 0 `prepare` adds the
  reference's, as DPO's are (the run's starting model, or under LoRA the frozen base).

  Its terms are sums over the loss's weight, so microbatches add theirs; `metrics` turns them
  into what is logged: the loss, and per completion token the KL, the ratio and the clipped
  shares, and the mean completion length."""
  epsilon_low: float = 0.2
  epsilon_high: float | None = None
  beta: float = 0.0
  normalization: str = 'sequence'
  max_completion_length: int = 0
  graphdef: object = None  # the model's, for the reference's forward where β > 0
  staged: bool = False  # under pipeline stages
  batch_keys = {'advantages': np.float32, 'old_logps': np.float32}

  def prepare(self, params, frozen, reference, batch, microbatches: int):
    if not self.beta:
      return batch
    if reference is None and not jax.tree.leaves(frozen):
      raise ValueError('GRPO: a KL term (beta > 0) needs the reference model: held in the '
                       'state, or under LoRA the frozen base')
    return {**batch, 'reference': dpo.reference_logps(self.graphdef, self.staged, params, frozen,
                                                      reference, batch, microbatches)}

  def sums(self, out, rows) -> dict:
    return policy_sums(dpo.answer_logps(out, rows), rows['old_logps'], rows.get('reference'),
                       rows['advantages'][:, 0], rows['weights'], epsilon_low=self.epsilon_low,
                       epsilon_high=self.epsilon_high, beta=self.beta,
                       normalization=self.normalization,
                       max_completion_length=self.max_completion_length)

  def weight(self, rows) -> jax.Array:
    """What the batch's sums are divided by: its completions, completion tokens, or completions
    × the length cap, as the normalisation says (policy_sums' 'weight' of the whole batch)."""
    lengths_B = rows['weights'].sum(1)
    completions = (lengths_B > 0).sum().astype(jnp.float32)
    if self.normalization == 'token':
      return lengths_B.sum()
    return completions * (self.max_completion_length if self.normalization == 'constant' else 1)

  def terms(self, sums: dict, total) -> dict:
    return {k: v / total for k, v in sums.items() if k != 'weight'}


def metrics(terms: dict) -> dict:
  """What GRPO's terms (summed over a step's microbatches) log: the loss, per completion token
  the KL, the ratio and the clipped shares, and the completions' mean length."""
  tokens = jnp.maximum(terms['tokens'], 1e-30)
  return {'loss': terms['loss'], 'kl': terms['kl'] / tokens, 'ratio': terms['ratio'] / tokens,
          'clip_ratio': terms['clipped'] / tokens, 'clip_ratio_low': terms['clipped_low'] / tokens,
          'clip_ratio_high': terms['clipped_high'] / tokens,
          'completion_length': terms['tokens'] / jnp.maximum(terms['completions'], 1e-30)}
