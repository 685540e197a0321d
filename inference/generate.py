"""Sampling from the model with a KV cache: the prompts go through once (prefill), then each new
token is one forward step of T=1 against the cache, so a token costs O(length), not O(length²).

Prompts of different lengths share one batch: row b's prompt fills positions 0 … P_b−1 (the
shorter rows are padded on the right, at position −1: the cache keeps nothing of a pad), its
first new token is read from the logits at P_b−1 and written at P_b.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Sampling(NamedTuple):
  """How each next token is chosen; part of the compiled decoding (a change compiles anew)."""
  temperature: float = 0.0  # 0: the most likely (greedy); else a draw from softmax(logits / it)
  top_k: int = 0  # among the k most likely only; 0: all
  top_p: float = 1.0  # then among the fewest most likely whose probability reaches p; 1: all

  def checked(self) -> 'Sampling':
    """Itself, with one-line errors naming the argument where it cannot be."""
    if not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise ValueError(f'temperature={self.temperature} must be a finite number ≥ 0 (0: greedy)')
    if self.top_k < 0:
      raise ValueError(f'top_k={self.top_k} must be ≥ 0 (0: all tokens)')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p={self.top_p} must be in (0, 1] (1: all tokens)')
    return Sampling(float(self.temperature), int(self.top_k), float(self.top_p))


def sample(logits_BV, keys_B, sampling: Sampling):
  """Next tokens: the argmax when the temperature is 0 (greedy), else a draw from what `tempered`
  leaves, row b with its own key keys_B[b] (so a row's draws do not depend on the rest of the
  batch)."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  return draw(keys_B, tempered(logits_BV, sampling))


def tempered(logits_BV, sampling: Sampling):
  """The logits `sample` draws from at a temperature > 0: divided by it, −inf outside the top_k
  most likely, then outside the nucleus: the most likely tokens until their probabilities reach
  top_p (the one that crosses it kept, as transformers' TopPLogitsWarper keeps it)."""
  logits_BV = logits_BV / sampling.temperature
  if sampling.top_k:
    kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
  if sampling.top_p < 1:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # the mass of the likelier ones
    kept_B = (before_BV < sampling.top_p).sum(-1)  # ≥ 1: the likeliest has none before it
    least_B1 = jnp.take_along_axis(sorted_BV, kept_B[:, None] - 1, axis=-1)
    logits_BV = jnp.where(logits_BV < least_B1, -jnp.inf, logits_BV)
  return logits_BV


def draw(keys_B, logits_BV):
  return jax.vmap(jax.random.categorical)(keys_B, logits_BV).astype(jnp.int32)


def row_keys(key, i, rows: int):
  """The keys that draw the i-th new token of rows 0 … rows−1."""
  step = jax.random.fold_in(key, i)
  return jax.vmap(lambda b: jax.random.fold_in(step, b))(jnp.arange(rows))


def mask_vocab(logits_BV, vocab_size: int | None):
  """Padding ids past the tokenizer's vocabulary are never sampled."""
  if vocab_size is None or vocab_size >= logits_BV.shape[-1]:
    return logits_BV
  return jnp.where(jnp.arange(logits_BV.shape[-1]) < vocab_size, logits_BV, -jnp.inf)


def generate(model, prompts, max_new_tokens: int, *, key=None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
             vocab_size: int | None = None, cache: str = 'full', pad_to: int = 1) -> np.ndarray:
  """New tokens [B, max_new_tokens] after each prompt (lists of token ids, each non-empty), each
  chosen as Sampling(temperature, top_k, top_p) says. A row that produced `eos_id` is filled with
  `pad_id` after it. `cache`: what the decoding keeps of past tokens (model/kv_cache.py: KINDS).
  The prompts are right-padded to a multiple of `pad_to` tokens (the same tokens: each row
  decodes from its own length)."""
  tokens, lengths = padded(prompts, pad_id, max_new_tokens, pad_to)
  graphdef, state = nnx.split(model)
  key = jax.random.key(0) if key is None else key
  out = _generate(graphdef, state, tokens, lengths, key, max_new_tokens=max_new_tokens,
                  sampling=Sampling(temperature, top_k, top_p).checked(),
                  eos_id=-1 if eos_id is None else int(eos_id), pad_id=int(pad_id),
                  vocab_size=vocab_size, cache=cache)
  return np.asarray(out)


def prompt_positions(lengths_B, P: int):
  """[B, P] positions of right-padded prompts: 0 … P_b − 1, then −1 for the pads."""
  positions_BP = jnp.arange(P, dtype=jnp.int32)[None, :]
  return jnp.where(positions_BP < lengths_B[:, None], positions_BP, -1)


def padded(prompts, pad_id: int, max_new_tokens: int, pad_to: int = 1):
  """The prompts (lists of token ids) as one right-padded [B, P] array and their lengths [B],
  the arguments checked."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError('generate: every prompt needs at least one token (e.g. BOS)')
  if max_new_tokens < 1:
    raise ValueError(f'generate: max_new_tokens={max_new_tokens} must be ≥ 1')
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.full((len(prompts), -(-lengths.max() // pad_to) * pad_to), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = prompt
  return tokens, lengths


@functools.partial(jax.jit, static_argnums=0, static_argnames=(
    'max_new_tokens', 'sampling', 'eos_id', 'pad_id', 'vocab_size', 'cache'))
def _generate(graphdef, state, tokens_BP, lengths_B, key, *, max_new_tokens, sampling, eos_id,
              pad_id, vocab_size, cache):
  model = nnx.merge(graphdef, state)
  B, P = tokens_BP.shape
  cache = model.init_cache(B, P + max_new_tokens, cache)
  logits_BPV, cache = model.decode(tokens_BP, prompt_positions(lengths_B, P), cache)
  last_BV = logits_BPV[jnp.arange(B), lengths_B - 1]

  def one_token(carry, i):
    last_BV, cache, done_B = carry
    token_B = sample(mask_vocab(last_BV, vocab_size), row_keys(key, i, B), sampling)
    token_B = jnp.where(done_B, pad_id, token_B)
    done_B = done_B | (token_B == eos_id)
    logits_B1V, cache = model.decode(token_B[:, None], (lengths_B + i)[:, None], cache)
    return (logits_B1V[:, 0], cache, done_B), token_B

  _, new_TB = jax.lax.scan(one_token, (last_BV, cache, jnp.zeros(B, bool)),
                           jnp.arange(max_new_tokens))
  return new_TB.T
