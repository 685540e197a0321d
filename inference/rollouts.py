"""Rollouts for reinforcement learning (training/grpo.py): G completions of each prompt, sampled by
the KV-cached sampler (inference/generate.py) from the model as it stands, in memory, and laid out
as the train step's rows with the log-probabilities of their completion tokens.

Row r = i·G + g holds prompt i's g-th completion: its tokens are the prompt, then the completion
up to and with its EOS (the model learns to stop), then padding. The targets are the tokens one
ahead, weighted 1 exactly where a target is a completion token; `logps` are log π of those targets
under the model that sampled them (π_old), 0 elsewhere.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference.generate import Sampling, generate
from training.dpo import answer_logps


@dataclasses.dataclass
class Rollouts:
  prompts: list[list[int]]  # a row's prompt (prompt i repeated G times)
  completions: list[list[int]]  # its completion, with its EOS where it ended by one
  rows: dict  # the train step's batch, numpy [R, length]; segment_ids 0 on padding
  group: int  # G: rows i·G … i·G + G − 1 answer prompt i


def sample(model, prompts: list[list[int]], group: int, max_new_tokens: int, length: int, *,
           sampling: Sampling, key, eos_id: int, pad_id: int, vocab_size: int | None = None,
           cache: str = 'full') -> Rollouts:
  """`group` completions of each prompt (token ids), rows of `length` tokens (module docstring).
  A row's draws depend on its key alone (generate's), so a rollout is the sampler's text for the
  same key."""
  if group < 2:
    raise ValueError(f'rollouts: a group of {group} completions gives no advantage; give ≥ 2')
  longest = max(map(len, prompts))
  if longest + max_new_tokens - 1 > length:
    raise ValueError(f'rollouts: prompts of up to {longest} tokens and {max_new_tokens} new ones '
                     f'need rows of {longest + max_new_tokens - 1}, more than {length}')
  repeated = [p for p in prompts for _ in range(group)]
  new = generate(model, repeated, max_new_tokens, key=key, temperature=sampling.temperature,
                 top_k=sampling.top_k, top_p=sampling.top_p, eos_id=eos_id, pad_id=pad_id,
                 vocab_size=vocab_size, cache=cache)
  completions = []
  for row in new.tolist():
    completions.append(row[:row.index(eos_id) + 1] if eos_id in row else row)
  return Rollouts(repeated, completions, layout(repeated, completions, length, pad_id), group)


def layout(prompts, completions, length: int, pad_id: int) -> dict:
  """The rows of prompt + completion (module docstring), numpy [R, length]."""
  R = len(prompts)
  tokens = np.full((R, length + 1), pad_id, np.int32)
  weights = np.zeros((R, length), np.float32)
  segments = np.zeros((R, length), np.int32)
  for r, (p, c) in enumerate(zip(prompts, completions)):
    whole = [*p, *c]
    tokens[r, :len(whole)] = whole
    weights[r, len(p) - 1:len(whole) - 1] = 1.0  # targets p[−1]+1 … the completion's last
    segments[r, :len(whole) - 1] = 1
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
          'positions': np.broadcast_to(np.arange(length, dtype=np.int32), (R, length)).copy(),
          'weights': weights, 'segment_ids': segments}


def logps(model, rows: dict) -> np.ndarray:
  """log π(target) of each completion token of `rows` under `model`, fp32 [R, length], 0 off
  them: a forward of the rows as the train step makes it, no gradient."""
  graphdef, state = nnx.split(model)
  return np.asarray(_logps(graphdef, state, {k: jnp.asarray(v) for k, v in rows.items()}))


@functools.partial(jax.jit, static_argnums=0)
def _logps(graphdef, state, rows):
  out, _ = nnx.merge(graphdef, state).output(rows['inputs'], rows['positions'],
                                             rows['segment_ids'])
  return jax.lax.stop_gradient(answer_logps(out, rows))
