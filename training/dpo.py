"""DPO's loss on preference records (config.data.record='preference' or 'chat_preference';
Rafailov et al. 2023), a loss of the same signature as the language model's (training/step.py:
LanguageModel): each row holds a pair, segment 1 the chosen answer, segment 2 the rejected one,
scored against the reference model's log-probabilities of the same answers."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from configs.base import DpoConfig


def pair_rows_B(rows):
  """[B] 1.0 where a row holds a whole pair (answers of both: segment 1 chosen, 2 rejected; an
  evaluation pass pads its last batch with empty rows), else 0."""
  answers = lambda segment: (rows['weights'] * (rows['segment_ids'] == segment)).sum(1) > 0
  return (answers(1) & answers(2)).astype(jnp.float32)


def pair_rows_sum(rows) -> jax.Array:
  """The pairs among `rows` (data replicas apart add theirs for the batch's weight)."""
  return pair_rows_B(rows).sum()


def answer_logps(out, rows):
  """log p of each weighted target, 0 elsewhere, fp32 [B, L]: the answers' tokens."""
  return -out.token_losses(rows['targets'])[0] * rows['weights']


def reference_logps(graphdef, staged: bool, params, frozen, reference, batch,
                    microbatches: int = 1):
  """The reference model's answer_logps of the batch, no gradient: the run's starting model,
  `reference` (held in the state), or under LoRA the frozen base with its adapters at zero
  (which adds nothing to a projection), so no second copy is held. Under pipeline stages
  (`staged`) each stage scores its share of the rows (the model sums the stages' results), so
  each puts its rows' log-probabilities in their places of a [B, L] of zeros."""
  if reference is None:
    reference = nnx.merge_state(jax.tree.map(jnp.zeros_like, params), frozen)
  model = nnx.merge(graphdef, reference)
  if not staged:
    out, _ = model.output(batch['inputs'], batch['positions'], batch.get('segment_ids'))
    return jax.lax.stop_gradient(answer_logps(out, batch))
  B, L = batch['inputs'].shape
  rows = {**batch, 'row': jnp.broadcast_to(jnp.arange(B)[:, None], (B, L))}

  def placed(out, share):
    logps_bL = answer_logps(out, share)
    return jnp.zeros((B, L), logps_bL.dtype).at[share['row'][:, 0]].set(logps_bL)
  logps_BL, _ = model(batch['inputs'], batch['positions'], batch.get('segment_ids'),
                      microbatches, then=placed, rows=rows)
  return jax.lax.stop_gradient(logps_BL)


def preference_sums(out, rows, dpo: DpoConfig) -> dict:
  """DPO's sums over a batch's pairs, fp32: with h the margin
  β·((log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)), the loss
  −(1−ε)·log σ(h) − ε·log σ(−h) (ε the label smoothing), and for the metrics how often h > 0
  (reward accuracy), h itself, each answer's implicit reward β·(log π − log π_ref), and the pairs.
  rows['reference']: the reference's answer_logps. Sums, so microbatches add theirs."""
  gain_BL = answer_logps(out, rows) - rows['reference']
  chosen_B = dpo.beta * jnp.where(rows['segment_ids'] == 1, gain_BL, 0.0).sum(1)
  rejected_B = dpo.beta * jnp.where(rows['segment_ids'] == 2, gain_BL, 0.0).sum(1)
  margin_B, pair_B = chosen_B - rejected_B, pair_rows_B(rows)
  eps = dpo.label_smoothing
  loss_B = -(1 - eps) * jax.nn.log_sigmoid(margin_B) - eps * jax.nn.log_sigmoid(-margin_B)
  summed = lambda x_B: jax.lax.stop_gradient((x_B * pair_B).sum())
  return {'loss': (loss_B * pair_B).sum(), 'reward_accuracy': summed(margin_B > 0),
          'reward_margin': summed(margin_B), 'chosen_reward': summed(chosen_B),
          'rejected_reward': summed(rejected_B), 'pairs': summed(jnp.ones_like(margin_B))}


@dataclasses.dataclass(frozen=True)
class DPO:
  """DPO as the step's loss: its rows carry the reference's log-probabilities (`prepare`), its
  sums are over pairs, and a batch weighs its pairs."""
  dpo: DpoConfig
  graphdef: object  # the model's, for the reference's forward
  staged: bool  # under pipeline stages

  def prepare(self, params, frozen, reference, batch, microbatches: int):
    return {**batch, 'reference': reference_logps(self.graphdef, self.staged, params, frozen,
                                                  reference, batch, microbatches)}

  def sums(self, out, rows) -> dict:
    return preference_sums(out, rows, self.dpo)

  def weight(self, rows) -> jax.Array:
    """What the batch's sums are divided by: its pairs."""
    return pair_rows_sum(rows)

  def terms(self, sums: dict, total) -> dict:
    return {k: v / total for k, v in sums.items() if k != 'pairs'}
