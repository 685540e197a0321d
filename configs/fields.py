"""A config's fields against their declarations (configs/base.py), before anything is imported
that a bad setting would waste: train.py checks them first, and `training.settings.resolve` again
(a notebook's config reaches only it)."""

import copy
import difflib

import ml_collections

from configs import base, effects, schema

UNSAVED = object()


def checked(config) -> dict:
  """The settings of `config` (a ConfigDict or its dict, never changed) as nested dicts, each it
  lacks at its default; ValueError naming the first that is not one meshlm has, or whose value
  its declaration refuses."""
  values = filled(config.to_dict() if hasattr(config, 'to_dict') else copy.deepcopy(config))
  check_fields(values)
  return values


def filled(values: dict) -> dict:
  """`values` with every setting it lacks at configs/base.py's default (a config written for an
  older meshlm, or a run's saved one)."""
  defaults = base.get_config().to_dict()
  for key, value in values.items():
    if isinstance(value, dict) and isinstance(defaults.get(key), dict):
      defaults[key].update(value)
    else:
      defaults[key] = value
  return defaults


def check_fields(values: dict, declared=base.Run) -> None:
  """The fields first: those configs/base.py declares, no others (a typo in a config file would
  otherwise set a field nothing reads); then every value against its declaration (a number
  finite and within its range, a choice among its choices: configs/schema.py)."""
  unknown(values, schema.config_dict(declared))
  for field, setting in schema.by_name(declared).items():
    if (value := effects.get(values, field, UNSAVED)) is not UNSAVED:
      schema.check_value(field, value, setting)


def unknown(values, known, prefix: str = '') -> None:
  """ValueError naming a field of a config's `values` that `known` (configs/base.py's config)
  lacks."""
  for key, value in values.items():
    if key not in known:
      hint = difflib.get_close_matches(key, list(known), n=1)
      raise ValueError(f'config.{prefix}{key} is not a setting meshlm has'
                       f'{f"; did you mean config.{prefix}{hint[0]}?" if hint else ""} '
                       '(configs/base.py lists every setting); fix the config file')
    if isinstance(value, (ml_collections.ConfigDict, dict)) and isinstance(
        known[key], (ml_collections.ConfigDict, dict)):
      unknown(value, known[key], f'{prefix}{key}.')
