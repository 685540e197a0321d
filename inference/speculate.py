"""Speculative decoding with the model's own draft heads (model/draft.py): the heads guess K
tokens, and one cached forward of the base over T = K + 1 tokens checks them all.

Each round a row holds its newest token t (chosen, not yet in the cache) at position n and the
base's last hidden state h before it. The heads guess d_1 … d_K after t from h; the base reads
[t, d_1 … d_K] at positions n … n+K, writing them into the cache, and its logits there give its
own distribution q_i for each guess d_i and q_{K+1} after the last. Guesses are kept from the
left while the base agrees:
  greedy: d_i is kept while it is the argmax of q_i; the first that is not is replaced by that
    argmax, so the output is plain greedy decoding's token for token (wherever the forward of
    K + 1 tokens rounds as the one of one token does: in fp32; docs/sampling.md on bf16);
  sampled: d_i, drawn from the head's distribution p_i, is kept with probability
    min(1, q_i(d_i) / p_i(d_i)); the first refused is replaced by a draw from
    max(0, q_i − p_i) normalised (Leviathan et al. 2023; Chen et al. 2023), so every token has
    the base's distribution at the same temperature, top_k and top_p.
With a guesses kept the round commits a + 1 tokens (the replacement, or a draw from q_{K+1} when
all K are kept, is the next round's t); the cache slots of refused guesses lie past the row's
length, where no query looks, and the next round writes over them.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.generate import (Sampling, draw, mask_vocab, padded, prompt_positions, row_keys,
                                sample, tempered)


def speculate(model, prompts, max_new_tokens: int, *, key=None, temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
              vocab_size: int | None = None, cache: str = 'full'):
  """(new tokens [B, max_new_tokens] as generate.generate gives them, stats): a row that produced
  `eos_id` is padded after it. stats: per row, `forwards` (rounds: the base's forwards after the
  prompt's), `tokens` (the new tokens those rounds committed, the first token, the prompt's,
  not counted) and `accepted` [B, K] (how often head k's guess was kept)."""
  if not model.cfg.draft_heads:
    raise ValueError('speculate: the model has no draft heads (config.model.draft_heads is 0)')
  tokens, lengths = padded(prompts, pad_id, max_new_tokens)
  graphdef, state = nnx.split(model)
  key = jax.random.key(0) if key is None else key
  out, forwards, count, accepted = _speculate(
      graphdef, state, tokens, lengths, key, max_new_tokens=max_new_tokens,
      sampling=Sampling(temperature, top_k, top_p).checked(),
      eos_id=-1 if eos_id is None else int(eos_id), pad_id=int(pad_id), vocab_size=vocab_size,
      cache=cache)
  return np.asarray(out), {'forwards': np.asarray(forwards), 'tokens': np.asarray(count) - 1,
                           'accepted': np.asarray(accepted)}


def _choices(logits_BTV, sampling: Sampling):
  """What `sample` draws from, as probabilities [..., V] (temperature > 0)."""
  shape = logits_BTV.shape
  flat = tempered(logits_BTV.reshape(-1, shape[-1]), sampling)
  return jax.nn.softmax(flat, axis=-1).reshape(shape)


class Rows(NamedTuple):
  """What a round of speculation carries for each row: the round (i), the cache, the base's last
  hidden state h [B, D] and its newest token t [B] at position pos [B] (not yet in the cache),
  the new tokens so far [B, N + K + 1] and how many, done [B], and the counts speculate
  reports."""
  i: jax.Array
  cache: dict
  h_BD: jax.Array
  token_B: jax.Array
  pos_B: jax.Array
  out_BN: jax.Array
  count_B: jax.Array
  done_B: jax.Array
  forwards_B: jax.Array
  accepted_BK: jax.Array


@functools.partial(jax.jit, static_argnums=0, static_argnames=(
    'max_new_tokens', 'sampling', 'eos_id', 'pad_id', 'vocab_size', 'cache'))
def _speculate(graphdef, state, tokens_BP, lengths_B, key, *, max_new_tokens, sampling, eos_id,
               pad_id, vocab_size, cache):
  model = nnx.merge(graphdef, state)
  K, N = model.cfg.draft_heads, max_new_tokens
  B, P = tokens_BP.shape
  # a local layer's ring keeps room for a round's K guesses past its window (kv_cache.ring_slots)
  cache = model.init_cache(B, P + N + K + 1, cache, ahead=K)
  x_BPD, cache = model.decode_hidden(tokens_BP, prompt_positions(lengths_B, P), cache)
  h_BD = x_BPD[jnp.arange(B), lengths_B - 1]
  first_B = sample(mask_vocab(model.logits(h_BD[:, None])[:, 0], vocab_size),
                   _keys(key, 0, 0, B), sampling)
  rows = Rows(i=jnp.int32(1), cache=cache, h_BD=h_BD, token_B=first_B, pos_B=lengths_B,
              out_BN=jnp.full((B, N + K + 1), pad_id, jnp.int32).at[:, 0].set(first_B),
              count_B=jnp.ones(B, jnp.int32), done_B=(first_B == eos_id) | (N == 1),
              forwards_B=jnp.zeros(B, jnp.int32), accepted_BK=jnp.zeros((B, K), jnp.int32))
  rows = jax.lax.while_loop(
      lambda rows: ~rows.done_B.all(),
      lambda rows: one_round(model, rows, key, max_new_tokens=N, sampling=sampling,
                             eos_id=eos_id, pad_id=pad_id, vocab_size=vocab_size),
      rows)
  return rows.out_BN[:, :N], rows.forwards_B, rows.count_B, rows.accepted_BK


def _keys(key, i, use: int, rows: int):
  """Round i's keys for one use (0: the next token, 1: accepting, 2: replacing, 3 + k: head k's
  guess), a key a row."""
  return row_keys(jax.random.fold_in(key, use), i, rows)


def one_round(model, rows: Rows, key, *, max_new_tokens, sampling: Sampling, eos_id, pad_id,
              vocab_size) -> Rows:
  """The heads guess, the base checks the guesses in one forward of K + 1 tokens a row, and each
  row not done commits the guesses kept and one token more (module docstring)."""
  K, N = model.cfg.draft_heads, max_new_tokens
  B = rows.token_B.shape[0]
  rows_B, i = jnp.arange(B), rows.i

  def choose(logits_BV, k):
    logits_BV = mask_vocab(logits_BV, vocab_size)
    if sampling.temperature == 0:
      return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
    logits_BV = tempered(logits_BV, sampling)
    return draw(_keys(key, i, 3 + k, B), logits_BV), jax.nn.softmax(logits_BV, axis=-1)

  drafts_BK, p_K = model.draft.propose(
      rows.h_BD, rows.token_B, model.embedding,
      lambda s_BD: model.logits(s_BD[:, None], normed=True)[:, 0], choose)
  feed_BT = jnp.concatenate([rows.token_B[:, None], drafts_BK], axis=1)
  positions_BT = rows.pos_B[:, None] + jnp.arange(K + 1, dtype=jnp.int32)
  x_BTD, cache = model.decode_hidden(feed_BT, positions_BT, rows.cache)
  logits_BTV = mask_vocab(model.logits(x_BTD), vocab_size)
  if sampling.temperature == 0:
    base_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    a_B = jnp.cumprod(drafts_BK == base_BT[:, :K], axis=1).sum(axis=1)
    next_B = base_BT[rows_B, a_B]
  else:
    q_BTV = _choices(logits_BTV, sampling)
    p_BKV = jnp.stack(p_K, axis=1)
    q_BK = jnp.take_along_axis(q_BTV[:, :K], drafts_BK[..., None], axis=-1)[..., 0]
    p_BK = jnp.take_along_axis(p_BKV, drafts_BK[..., None], axis=-1)[..., 0]
    u_BK = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(_keys(key, i, 1, B))
    a_B = jnp.cumprod(u_BK * p_BK < q_BK, axis=1).sum(axis=1)
    # Where a guess was refused, what is left of q over p; after K kept, q_{K+1} itself.
    p_BTV = jnp.concatenate([p_BKV, jnp.zeros_like(q_BTV[:, :1])], axis=1)
    rest_BV = jnp.maximum(q_BTV[rows_B, a_B] - p_BTV[rows_B, a_B], 0.0)
    rest_BV = jnp.where(rest_BV.sum(-1, keepdims=True) > 0, rest_BV, q_BTV[rows_B, a_B])
    next_B = draw(_keys(key, i, 2, B), jnp.log(rest_BV))
  # The round's tokens: the a guesses kept, then the next; up to an end of document, and N.
  slot_T = jnp.arange(K + 1)
  new_BT = jnp.where(slot_T < a_B[:, None], jnp.pad(drafts_BK, ((0, 0), (0, 1))),
                     next_B[:, None])
  eos_BT = (new_BT == eos_id) & (slot_T <= a_B[:, None])
  ended_B = eos_BT.any(axis=1)
  n_B = jnp.where(ended_B, jnp.argmax(eos_BT, axis=1) + 1, a_B + 1)
  n_B = jnp.minimum(n_B, N - rows.count_B)
  new_BT = jnp.where(slot_T < n_B[:, None], new_BT, pad_id)
  written_BN = jax.vmap(lambda o, new, c: jax.lax.dynamic_update_slice(o, new, (c,)))(
      rows.out_BN, new_BT, rows.count_B)
  live_B = ~rows.done_B
  live = lambda new, old: jnp.where(live_B.reshape(-1, *[1] * (new.ndim - 1)), new, old)
  count_B = rows.count_B + jnp.where(live_B, n_B, 0)
  return Rows(i=i + 1, cache=cache, h_BD=live(x_BTD[rows_B, a_B], rows.h_BD),
              token_B=live(next_B, rows.token_B), pos_B=live(rows.pos_B + a_B + 1, rows.pos_B),
              out_BN=live(written_BN, rows.out_BN), count_B=count_B,
              done_B=rows.done_B | ended_B | (count_B >= N),
              forwards_B=rows.forwards_B + live_B,
              accepted_BK=rows.accepted_BK + (live_B[:, None] & (jnp.arange(K) < a_B[:, None])))
