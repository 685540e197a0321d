"""Evaluation: a fixed pass over the validation split, reported as loss and bits per byte; on
preference pairs, as DPO's loss and how often the held-out chosen answer wins (reward accuracy).

Bits per byte = total nats / ln 2 / bytes of text the targets stand for (EOS targets count their
loss and no bytes), which compares runs with different tokenizers on the same text.
"""

import math

import jax

from data import pipeline
from training import programs
from training.step import prefers


class Evaluator:
  """`evaluator(state)` → {'eval_loss', 'eval_bits_per_byte', 'eval_tokens'} (on preference
  pairs {'eval_loss', 'eval_reward_accuracy', 'eval_reward_margin', 'eval_pairs'}); every call
  reads the same batches: the first config.eval_batches of the split, or all of it when that is 0."""

  @staticmethod
  def compile(setup):
    """The eval step compiled for setup's run: its batch shape, tokenizer and microbatches."""
    run = setup.run
    return programs.compile_eval_step(setup, run.batch_size, run.seq_len,
                                      run.tokenizer.token_bytes(), run.microbatches)

  def __init__(self, setup, step, validation, batch_sharding):
    """`step`: `Evaluator.compile`'s; `validation`: the split's documents as token ids
    (data/tokens.py), read with the tokenizer of setup's run."""
    run, tokenizer = setup.run, setup.run.tokenizer
    self.pairs = prefers(setup)
    self.docs = pipeline.documents(validation, seed=None)
    self.shape = (run.batch_size, run.seq_len)
    self.n_batches = run.eval_batches or pipeline.pass_length(self.docs, *self.shape, self.pairs)
    self.sharding, self.pad_id, self.step = batch_sharding, tokenizer.pad_id, step

  def __call__(self, state) -> dict:
    # A pass is short: it runs in this process, since starting workers would cost more.
    batches = pipeline.Batches(self.docs, batch_sharding=self.sharding, batch_size=self.shape[0],
                               seq_len=self.shape[1], pad_id=self.pad_id, epochs=1,
                               pairs=self.pairs)
    reference = getattr(state, 'reference', None)
    totals = {}
    for _ in range(self.n_batches):
      # Waiting for each batch bounds the work in flight (XLA:CPU deadlocks with hundreds queued).
      sums = jax.device_get(self.step(state.params, reference, next(batches)))
      totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
    return means(totals, self.pairs)


def means(totals: dict, pairs: bool) -> dict:
  """A pass's figures from its sums (of preference `pairs`, or of tokens); a mean over no pair or
  no token is absent, never 0, and the count says why."""
  if pairs:
    n = totals.get('pairs', 0)
    if not n:
      return {'eval_pairs': 0}
    return {'eval_loss': totals['loss'] / n, 'eval_reward_accuracy': totals['reward_accuracy'] / n,
            'eval_reward_margin': totals['reward_margin'] / n, 'eval_pairs': int(n)}
  tokens = totals.get('tokens', 0)
  if not tokens:
    return {'eval_tokens': 0}
  return {'eval_loss': totals['nats'] / tokens,
          'eval_bits_per_byte': totals['nats'] / math.log(2) / max(totals['bytes'], 1),
          'eval_tokens': int(tokens)}
