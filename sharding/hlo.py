"""Reading a compiled program's HLO text (`compiled.as_text()`): its computations, their
instructions in scheduled order, array types, and how often one execution runs each computation.

A computation inside a `lax.scan` body (the layer stack) appears once in the text but runs once per
layer: `runs` walks the computations from ENTRY, and a while loop's body counts its known trip
count (XLA's `known_trip_count`) times, its condition one more.
"""

import collections
import dataclasses
import math
import re

DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 'bf16': 2, 'f16': 2,
               's16': 2, 'u16': 2, 'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
_COMPUTATION = re.compile(r'^(ENTRY )?%?([\w.\-]+) .*\{$')
_INSTRUCTION = re.compile(r'^\s*(ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(')
_ARRAY = re.compile(r'([a-z][a-z0-9]*)\[([0-9,]*)\]')
_CALLS = re.compile(r'\b(body|condition|calls|to_apply|true_computation|false_computation|'
                    r'branch_computations)=(\{[^}]*\}|%?[\w.\-]+)')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_PARTITIONS = re.compile(r'num_partitions=(\d+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  type: str  # the result's type as written: `bf16[8,128]{1,0}`, or a tuple of them
  opcode: str
  operands: tuple[str, ...]  # names of the instructions it reads
  line: str
  root: bool

  @property
  def arrays(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return arrays(self.type)

  @property
  def op_name(self) -> str:
    """The JAX operation it comes from (its metadata), or ''."""
    return m.group(1) if (m := _OP_NAME.search(self.line)) else ''

  def callees(self) -> list[tuple[str, str]]:
    """[(how, computation)] it calls: body, condition, calls, to_apply, branch_computations…"""
    return [(kind, callee) for kind, names in _CALLS.findall(self.line)
            for callee in re.findall(r'%?([\w.\-]+)', names.strip('{}'))]

  @property
  def trip_count(self) -> int:
    """A while loop's known trip count (1 where XLA states none)."""
    return int(m.group(1)) if (m := _TRIP_COUNT.search(self.line)) else 1


def instruction(line: str) -> Instruction | None:
  """The instruction a line of a computation holds, or None."""
  if not (m := _INSTRUCTION.match(line)):
    return None
  depth, end = 1, m.end()
  while depth and end < len(line):  # the operand list runs to the matching parenthesis
    depth += {'(': 1, ')': -1}.get(line[end], 0)
    end += 1
  operands = tuple(re.findall(r'%([\w.\-]+)', line[m.end():end - 1]))
  return Instruction(m.group(2), m.group(3), m.group(4), operands, line, bool(m.group(1)))


def arrays(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
  """(dtype, shape) of each array in a type: one, or each element of a tuple."""
  return tuple((dtype, tuple(int(d) for d in dims.split(',') if d))
               for dtype, dims in _ARRAY.findall(type_text))


def nbytes(array_list) -> int:
  """Bytes of (dtype, shape) arrays (4 a value for a type not in DTYPE_BYTES)."""
  return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(shape) for dtype, shape in array_list)


def parse(hlo_text: str):
  """({computation: [instruction lines]}, entry name, device count)."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    if current is None:
      if m := _COMPUTATION.match(line.strip()):
        current = m.group(2)
        computations[current] = []
        entry = current if m.group(1) else entry
    elif line.strip() == '}':
      current = None
    else:
      computations[current].append(line)
  devices = int(m.group(1)) if (m := _PARTITIONS.search(hlo_text)) else 1
  return computations, entry, devices


def runs(hlo_text: str) -> tuple[dict, collections.Counter, int]:
  """({computation: its instruction lines}, {computation: times one execution of the program
  runs it}, device count): the walk from ENTRY the module docstring describes."""
  computations, entry, devices = parse(hlo_text)
  times = collections.Counter()

  def visit(name: str, count: int) -> None:
    times[name] += count
    for line in computations.get(name, ()):
      if not (inst := instruction(line)) or inst.opcode in ('async-update', 'async-done'):
        continue  # their `calls` is the computation the async-start already counted
      trips = inst.trip_count
      for kind, callee in inst.callees():
        factor = {'body': trips, 'condition': trips + 1}.get(kind, 1) if inst.opcode == 'while' else 1
        if kind != 'to_apply':  # reductions' scalar computations: nothing to count
          visit(callee, count * factor)

  if entry is not None:
    visit(entry, 1)
  return computations, times, devices
