"""The collectives in a compiled program's HLO text: which ops, their result shapes and bytes.

A collective inside a `lax.scan` body (the layer stack) appears once in the text but runs once
per layer; these helpers read the text, so they count it once.
"""

import re

OPS = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')
_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 'bf16': 2, 'f16': 2, 's16': 2,
          'u16': 2, 'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
_LINE = re.compile(rf'= (.*?) ({"|".join(OPS)})(?:-start)?\(')
_ARRAY = re.compile(r'([a-z0-9]+)\[([0-9,]*)\]')


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...], int]]:
  """(op, result shape, result bytes) for every collective's result (each element of a tuple
  result separately); async pairs (`-start`/`-done`) count once."""
  found = []
  for line in hlo_text.splitlines():
    if m := _LINE.search(line):
      for dtype, dims in _ARRAY.findall(m.group(1)):
        shape = tuple(int(d) for d in dims.split(',') if d)
        size = _BYTES.get(dtype, 4)
        for d in shape:
          size *= d
        found.append((m.group(2), shape, size))
  return found


def shapes(hlo_text: str, op: str) -> list[tuple[int, ...]]:
  """Result shapes of every `op` (e.g. 'all-gather')."""
  return [shape for name, shape, _ in collectives(hlo_text) if name == op]


def summary(hlo_text: str) -> dict[str, dict[str, int]]:
  """{op: {'count': n, 'bytes': total result bytes}} for the ops the program has."""
  out = {}
  for op, _, size in collectives(hlo_text):
    entry = out.setdefault(op, {'count': 0, 'bytes': 0})
    entry['count'] += 1
    entry['bytes'] += size
  return out
