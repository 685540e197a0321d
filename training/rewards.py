"""Rewards for reinforcement learning (training/grpo.py) as the user's own Python functions, named
`module:function` (a module on the path, or a file: `path/to/file.py:function`), called on the
host as TRL calls its reward functions: `function(prompts, completions, **fields) -> floats`,
with `fields` each record's other fields as lists (a function names those it reads, or takes
**kwargs for all). Several are summed with weights, and each one's mean is kept for the logs.

A reward that cannot be loaded, reads a field the records lack, raises, or returns anything but
one finite number a completion stops the run with one line naming it: a reward silently zero
would train toward nothing in particular.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import math
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

# What every reward function is given besides the records' fields
GIVEN = ('prompts', 'completions')


class RewardError(ValueError):
  """A reward that cannot serve, in one line naming it (and the setting that named it)."""


@dataclasses.dataclass(frozen=True)
class Reward:
  spec: str  # as the setting names it: module:function
  weight: float
  fn: Callable

  def reads(self) -> tuple[set, bool]:
    """(the record fields it must be given, whether it takes every field: **kwargs)."""
    params = inspect.signature(self.fn).parameters.values()
    required = {p.name for p in params if p.default is p.empty and p.name not in GIVEN
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return required, any(p.kind == p.VAR_KEYWORD for p in params)


def load(specs: Sequence[str], weights: Sequence[float] | None = None,
         setting: str = 'config.rl.rewards') -> list[Reward]:
  """The rewards `specs` names, each with its weight (default 1 each)."""
  if not specs:
    raise RewardError(f'{setting} names no reward: give module:function, e.g. '
                      'my_rewards:exact_answer')
  weights = [1.0] * len(specs) if weights is None else list(weights)
  if len(weights) != len(specs):
    raise RewardError(f'{setting}: {len(specs)} rewards but {len(weights)} weights; give one '
                      'weight each')
  return [Reward(spec, float(w), _function(spec, setting)) for spec, w in zip(specs, weights)]


def _function(spec: str, setting: str) -> Callable:
  where, _, name = spec.rpartition(':')
  if not where or not name:
    raise RewardError(f'{setting}: {spec!r} is not module:function (or path/to/file.py:function)')
  try:
    if where.endswith('.py'):
      path = pathlib.Path(where)
      if not path.is_file():
        raise FileNotFoundError(f'no file {path}')
      loader = importlib.util.spec_from_file_location(path.stem, path)
      module = importlib.util.module_from_spec(loader)
      loader.loader.exec_module(module)
    else:
      module = importlib.import_module(where)
  except Exception as e:  # the user's module: whatever stops its import, named in one line
    raise RewardError(f'{setting}: {spec!r} cannot be imported ({type(e).__name__}: {e})') from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise RewardError(f'{setting}: {where} has no function {name!r}')
  return fn


def check_fields(rewards: Sequence[Reward], fields: set, setting: str = 'config.rl.rewards'
                 ) -> None:
  """Before anything is compiled: every field a reward must be given is one the records hold."""
  for r in rewards:
    missing = sorted(r.reads()[0] - set(fields))
    if missing:
      raise RewardError(f'{setting}: {r.spec} reads {missing}, which the records lack (they hold '
                        f'{sorted(fields)})')


def score(rewards: Sequence[Reward], prompts: list[str], completions: list[str],
          records: list[dict]) -> tuple[np.ndarray, dict]:
  """(the weighted sum of the rewards, float32 [completions]; {spec: its mean}) of `completions`,
  completion i answering prompts[i] of records[i]."""
  n = len(completions)
  if not len(prompts) == len(records) == n:
    raise ValueError(f'score: {len(prompts)} prompts, {n} completions, {len(records)} records')
  columns = {k: [record.get(k) for record in records] for k in (records[0] if records else {})
             if k not in GIVEN}
  total, means = np.zeros(n, np.float64), {}
  for r in rewards:
    every = r.reads()[1]
    names = set(inspect.signature(r.fn).parameters)
    given = columns if every else {k: v for k, v in columns.items() if k in names}
    try:
      values = r.fn(prompts=prompts, completions=completions, **given)
    except Exception as e:  # the user's function: its failure named, never a silent zero
      raise RewardError(f'reward {r.spec} raised {type(e).__name__}: {e}') from None
    values = _checked(r.spec, values, n)
    total += r.weight * values
    means[r.spec] = float(values.mean())
  return total.astype(np.float32), means


def _checked(spec: str, values, n: int) -> np.ndarray:
  try:
    out = np.asarray([float(v) for v in values], np.float64)
  except (TypeError, ValueError):
    raise RewardError(f'reward {spec} returned {type(values).__name__}, not one number a '
                      'completion') from None
  if out.shape != (n,):
    raise RewardError(f'reward {spec} returned {out.shape[0]} values for {n} completions')
  bad = [i for i, v in enumerate(out) if not math.isfinite(v)]
  if bad:
    raise RewardError(f'reward {spec} returned {out[bad[0]]} for completion {bad[0]} (and '
                      f'{len(bad) - 1} more): every reward must be finite')
  return out
