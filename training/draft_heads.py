"""The draft heads' part of a step (model/draft.py: K heads that guess the tokens after the next,
for speculative decoding): their losses' sums beside the base's, their metrics, and the gradient
norms that keep the base's grad_norm what it would be without them."""

import jax.numpy as jnp
import optax

from model import draft
from model.layers import Draft, split_adapters


def sums(out, rows) -> dict:
  """The draft heads' weighted sums over the batch, [K] each: nats, top-1 hits and the weight
  of the tokens they guess, through the base's embedding and head (their gradients reach neither).
  Sums, so microbatches and data replicas add."""
  nll_KBL, gap_KBL = out.draft_losses(rows['targets'])
  w_KBL = draft.weights(rows['weights'], rows.get('segment_ids'), nll_KBL.shape[0])
  return {'nats': (nll_KBL * w_KBL).sum((1, 2)), 'hits': ((gap_KBL == 0) * w_KBL).sum((1, 2)),
          'tokens': w_KBL.sum((1, 2))}


def metrics(sums_: dict) -> dict:
  """Each head's mean loss and top-1 accuracy over the tokens it guessed: draft1_loss, …"""
  if not sums_:
    return {}
  tokens_K = jnp.maximum(sums_['tokens'], 1.0)
  out = {}
  for k in range(tokens_K.shape[0]):
    out[f'draft{k + 1}_loss'] = sums_['nats'][k] / tokens_K[k]
    out[f'draft{k + 1}_accuracy'] = sums_['hits'][k] / tokens_K[k]
  return out


def gradient_norms(cfg, grads):
  """(the norm of all the gradients, the metrics that replace it where draft heads train beside
  the model: grad_norm the model's alone, as it would be without them, and draft_grad_norm)."""
  if not cfg.draft_heads or cfg.draft_only:
    return optax.tree.norm(grads), {}
  drafts, model = split_adapters(grads, Draft)
  model_norm, drafts_norm = optax.tree.norm(model), optax.tree.norm(drafts)
  return jnp.hypot(model_norm, drafts_norm), {'grad_norm': model_norm,
                                              'draft_grad_norm': drafts_norm}
