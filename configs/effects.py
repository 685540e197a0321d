"""What changing a setting does to a run. Every setting declares one kind, once, in its field of
configs/base.py (`base.EFFECTS` gathers them); whatever compares two runs derives what it compares
from those declarations, so a new setting cannot be forgotten (a field without one is refused):

  kind      what the setting changes                                   resumed run   init_from
  shape     the arrays of the base model (a checkpoint's shapes)       kept          the checkpoint's
  function  the numbers the base model computes from its arrays        kept          the checkpoint's
  added     LoRA adapters and draft heads: their arrays and function   kept          free (fresh)
  data      what the steps read, and where the run starts from         kept          free
  schedule  how the optimizer moves, from the step it applies at       may change    free
  numerics  the same function computed another way: precision,        may change    free
            kernels, layout, memory
  none      nothing trained: logging, evaluation, workdir, runtime     may change    free

A setting's kind may depend on the run (base.DEPENDS: in an MoE that drops tokens, the layout
decides which, so the mesh and microbatches are `function` there). A resumed run refuses a change
to a kept setting, naming it (runtime/checkpoint.py: check_resume).
A run started from another's parameters (config.init_from) takes the base model's settings from
the checkpoint, a meshlm run's or a Hugging Face model's, and refuses one given otherwise
(training/settings.py). sample.py and export.py rebuild the run from a checkpoint's shape,
function, added, data and numerics settings (but for its training's layout: the mesh, partition,
optimizer tiers and microbatches), and take the rest (logging, plans, the runtime) as this
machine's (inference/sampling.py). `python -m configs.effects` prints the table
docs/checkpoints.md shows.
"""

import ml_collections

from configs.schema import KINDS  # kind: what changing a setting of it does

KEPT_ON_RESUME = ('shape', 'function', 'added', 'data')  # a resumed run refuses changes to these
FROM_CHECKPOINT = ('shape', 'function')  # config.init_from's checkpoint decides these
MODEL = ('shape', 'function', 'added')  # a model's arrays and what it computes


def fields(config, prefix: str = '') -> list[str]:
  """Every setting of `config`, nested ones as 'model.d_model'."""
  out = []
  for key, value in config.items():
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      out += fields(value, f'{prefix}{key}.')
    else:
      out.append(f'{prefix}{key}')
  return out


def of_kinds(kinds, effects: dict | None = None) -> list[str]:
  """The settings declared of any of `kinds`, in declaration order."""
  if effects is None:
    from configs import base  # base.py declares them, and imports this module for the kinds
    effects = base.EFFECTS
  return [field for field, kind in effects.items() if kind in kinds]


def get(config, field: str, missing=None):
  """The value of `field` ('model.d_model') in a config or a saved config's dict; `missing` where
  it has none (a checkpoint written before the setting existed)."""
  for key in field.split('.'):
    if not hasattr(config, 'keys') or key not in config:
      return missing
    config = config[key]
  return config


_MISSING = object()


def kind_of(field: str, settings, effects: dict | None = None) -> str:
  """What `field` changes in the run of these `settings` (a config, or a saved one's dict): its
  declared kind (in `effects`, default base.EFFECTS), or the one base.DEPENDS gives it there."""
  from configs import base
  kind, applies, _ = base.DEPENDS.get(field, (None, None, None))
  return kind if kind and applies(settings) else (base.EFFECTS if effects is None else effects)[field]


def changed(saved, config, kinds, effects: dict | None = None) -> list[tuple[str, object, object]]:
  """(field, saved value, value here) for each setting of `kinds` in the saved run (kind_of) that
  differs; settings the saved config lacks (an older meshlm's) are not compared. `effects`: the
  declarations (default base.EFFECTS)."""
  from configs import base
  effects = base.EFFECTS if effects is None else effects
  out = []
  for field in effects:
    if kind_of(field, saved, effects) not in kinds:
      continue
    before, now = get(saved, field, _MISSING), get(config, field, _MISSING)
    if before is not _MISSING and now is not _MISSING and before != now:
      out.append((field, before, now))
  return out


def table(effects: dict | None = None) -> str:
  """The declarations (`effects`, default base.EFFECTS) as a Markdown table, a row per kind
  (docs/checkpoints.md holds it)."""
  resume = {kind: 'kept' if kind in KEPT_ON_RESUME else 'may change' for kind in KINDS}
  start = {kind: "the checkpoint's" if kind in FROM_CHECKPOINT else 'free' for kind in KINDS}
  rows = ['| kind | what it changes | resumed run | `init_from` | settings |',
          '| --- | --- | --- | --- | --- |']
  for kind, what in KINDS.items():
    names = ', '.join(f'`{f}`' for f in of_kinds((kind,), effects))
    rows.append(f'| {kind} | {what} | {resume[kind]} | {start[kind]} | {names} |')
  from configs import base
  depends = {}
  for field, (kind, _, why) in base.DEPENDS.items():
    depends.setdefault((kind, why), []).append(f'`{field}`')
  notes = [f'\n{", ".join(fields)}: {kind} where {why} (a resumed run keeps them).'
           for (kind, why), fields in depends.items()]
  return '\n'.join(rows) + '\n' + ''.join(notes) + ('\n' if notes else '')


if __name__ == '__main__':
  print(table(), end='')
