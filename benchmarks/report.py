"""The end every benchmark shares: its figures to --out (pretty JSON) and as stdout's last line
(after a table for people: reporting.metrics.print_table)."""

import json
import pathlib
import shlex
import sys

from sharding import AXES


def emit(figures: dict, out_path: str | None) -> None:
  if out_path:
    with open(out_path, 'w') as f:
      f.write(json.dumps(figures, indent=2) + '\n')
  print(json.dumps(figures))


def command() -> str:
  """How this benchmark was run, as one would type it again: python -m benchmarks.NAME FLAGS."""
  return ' '.join(['python -m', f'benchmarks.{pathlib.Path(sys.argv[0]).stem}',
                   *map(shlex.quote, sys.argv[1:])])


def parse_mesh(text: str) -> dict:
  """{axis: size} of a --meshes entry `axis=size,…` (unnamed axes 1)."""
  mesh = dict.fromkeys(AXES, 1)
  for part in text.split(','):
    axis, _, size = part.partition('=')
    if axis.strip() not in AXES or not size.strip().isdigit():
      raise ValueError(f'--meshes: {part!r} is not axis=size with an axis of {AXES}')
    mesh[axis.strip()] = int(size)
  return mesh
