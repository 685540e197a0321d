"""How a setting is declared, once: a field of its section's frozen dataclass (configs/base.py)
carrying its default, a line of doc, its effect (a kind of configs/effects.py), the values it may
take (a range or choices) and, where it has one, its name in a Hugging Face config.json.

  d_model: int = setting(64, 'the width of the residual stream', 'shape', range=at_least(1),
                         hf='hidden_size')

Everything else is derived from the declarations, never written again: the ml-collections config
(`config_dict`, what `--config.x` overrides), the effects (`effects`), the checks of each value
(`check_value`, run on the raw config by training/settings.py and by each section as it is built),
the Hugging Face names (`hf_names`) and the settings' table in docs/settings.md (`table`). A
section's `check` holds only what crosses its fields. `python -m configs.base` prints the table.
"""

import dataclasses
import math
import typing

import ml_collections

# What changing a setting does to a run, by kind (configs/effects.py: what a resumed run, init_from,
# sampling and export do with each).
KINDS = {
    'shape': 'the arrays of the base model',
    'function': 'the numbers the base model computes from its arrays',
    'added': 'LoRA adapters and draft heads: their arrays and what they compute',
    'data': 'what the steps read, and where the run starts from',
    'schedule': 'how the optimizer moves, from the step it applies at',
    'numerics': 'the same function computed another way: precision, kernels, layout, memory',
    'none': 'nothing trained: logging, evaluation, the workdir, the runtime, plans',
}


@dataclasses.dataclass(frozen=True)
class Setting:
  doc: str  # what it does, one line (the docs' table shows it)
  effect: str  # what changing it does to a run: one of KINDS
  range: tuple | None = None  # (predicate, 'in [0, 1)'): the numbers it may be
  choices: tuple | None = None  # the values it may be
  hf: str = ''  # its name in a Hugging Face config.json


def setting(default, doc: str, effect: str, *, range=None, choices=None, hf: str = ''):
  """A section's field declaring a setting (module docstring)."""
  if effect not in KINDS:
    raise TypeError(f'effect {effect!r} is not one of {KINDS}')
  if choices is not None and default not in choices:
    raise TypeError(f'default {default!r} is not one of its choices {choices}')
  return dataclasses.field(default=default,
                           metadata={'setting': Setting(doc, effect, range, choices, hf)})


def section(kind: type):
  """The Run's field holding a section (`kind`, a Section: its docstring says what it is)."""
  return dataclasses.field(metadata={'section': kind})


def at_least(low):
  return lambda value: value >= low, f'at least {low}'


POSITIVE = (lambda value: value > 0, 'positive')
SHARE = (lambda value: 0 <= value < 1, 'in [0, 1)')


def between(low, high):
  return lambda value: low <= value <= high, f'in [{low}, {high}]'


class Section:
  """A frozen dataclass of settings, named `config.<name>`: built, it checks each value against
  its declaration, then `check`, what crosses its fields (ValueError naming the setting)."""
  SECTION: typing.ClassVar[str]  # its name in the config: config.<SECTION>.<field>

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if declared := field.metadata.get('setting'):
        check_value(f'{self.SECTION}.{field.name}', getattr(self, field.name), declared)
    self.check()

  def check(self) -> None:
    """What crosses this section's fields; ValueError naming the setting."""


def check_value(field: str, value, declared: Setting) -> None:
  """ValueError naming `config.<field>` for a value its declaration refuses: a number that is
  not finite or outside its range, a value not among its choices."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    if not math.isfinite(value):
      raise ValueError(f'config.{field}={value} is not a number a run can use; give a finite one')
    if declared.range and not declared.range[0](value):
      raise ValueError(f'config.{field}={value} must be {declared.range[1]}')
  if declared.choices is not None and value not in declared.choices:
    raise ValueError(f'config.{field}={value!r} is not one of '
                     f'{", ".join(str(choice) for choice in declared.choices)}')


def declared(kind: type, prefix: str = ''):
  """(dotted name, Setting, default) of every setting of a Run or section class, nested ones as
  'model.d_model', in declaration order."""
  for field in dataclasses.fields(kind):
    if setting_ := field.metadata.get('setting'):
      yield prefix + field.name, setting_, field.default
    elif inner := field.metadata.get('section'):
      yield from declared(inner, f'{prefix}{field.name}.')


def sections(kind: type) -> dict[str, type]:
  """{name: section class} of a Run class."""
  return {field.name: field.metadata['section'] for field in dataclasses.fields(kind)
          if 'section' in field.metadata}


def config_dict(kind: type) -> ml_collections.ConfigDict:
  """The ml-collections config of a Run class: every setting at its default, each section a
  ConfigDict of its own (what `--config.model.d_model=…` overrides, type-checked)."""
  config = ml_collections.ConfigDict()
  for name, _, default in declared(kind):
    *path, key = name.split('.')
    node = config
    for part in path:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    node[key] = default
  return config


def effects(kind: type) -> dict[str, str]:
  """{setting: its effect} of a Run class, in declaration order."""
  return {name: setting_.effect for name, setting_, _ in declared(kind)}


def by_name(kind: type) -> dict[str, Setting]:
  """{setting: its declaration} of a Run class."""
  return {name: setting_ for name, setting_, _ in declared(kind)}


def hf_names(kind: type) -> dict[str, str]:
  """{field: its name in a Hugging Face config.json} of a section class."""
  return {name: setting_.hf for name, setting_, _ in declared(kind) if setting_.hf}


def table(kind: type) -> str:
  """Every setting of a Run class as Markdown, a table a section (docs/settings.md)."""
  def row(name, setting_, default):
    allowed = (', '.join(f'`{choice}`' for choice in setting_.choices) if setting_.choices
               else setting_.range[1] if setting_.range else '')
    doc = setting_.doc.replace('|', '\\|')
    return f'| `{name}` | `{default!r}` | {allowed} | {setting_.effect} | {doc} |'
  head = ['| setting | default | may be | effect | what it does |', '| --- | --- | --- | --- | --- |']
  top = [row(*entry) for entry in declared(kind) if '.' not in entry[0]]
  parts = ['## config\n', *head, *top]
  for name, inner in sections(kind).items():
    parts += [f'\n## config.{name}\n', ' '.join((inner.__doc__ or '').split()) + '\n', *head,
              *(row(*entry) for entry in declared(inner, f'{name}.'))]
  return '\n'.join(parts) + '\n'

