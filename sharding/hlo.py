"""Reading a compiled program's HLO text (`compiled.as_text()`): its computations, their
instructions in scheduled order, array types, and how often one execution runs each computation.

A computation inside a `lax.scan` body (the layer stack) appears once in the text but runs once per
layer: `runs` walks the computations from ENTRY, and a while loop's body counts its trip count
(`trips`: XLA's `known_trip_count`, or read from the loop where a pass dropped it) times, its
condition one more.
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
_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"')
_CONSTANT = re.compile(r'constant\((-?\d+)\)')
_DIRECTION = re.compile(r'direction=(\w+)')
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


def trips(inst: Instruction, computations: dict, computation: str) -> int | None:
  """How many times the while loop `inst` (an instruction of `computation`) runs its body: XLA's
  `known_trip_count`, or, where a pass dropped it (the collective pipeliner, peeling a loop's
  first iteration), read from the loop: the induction variable XLA names starts at a constant
  (its init traced through copies), steps by a constant (the body's add) and runs while below a
  constant (the condition's compare). None where neither says."""
  if m := _TRIP_COUNT.search(inst.line):
    return int(m.group(1))
  if not (m := _INDUCTION.search(inst.line)) or not inst.operands:
    return None
  index, callees = int(m.group(1)), dict(inst.callees())
  scope = _by_name(computations, computation)
  init = scope.get(inst.operands[0])
  if init is None or init.opcode != 'tuple' or len(init.operands) <= index:
    return None
  start = _constant(scope, init.operands[index])
  body = _by_name(computations, callees.get('body', ''))
  root = next((i for i in body.values() if i.root), None)
  step = (_added_constant(computations, body, root.operands[index])
          if root and root.opcode == 'tuple' and len(root.operands) > index else None)
  bound = _bound(computations, callees.get('condition', ''))
  if None in (start, step, bound) or step <= 0:
    return None
  end, inclusive = bound
  return max(0, -(-(end + inclusive - start) // step))


def _by_name(computations: dict, computation: str) -> dict:
  return {i.name: i for line in computations.get(computation, ()) if (i := instruction(line))}


def _through_copies(scope: dict, name: str):
  inst = scope.get(name)
  while inst is not None and inst.opcode in ('copy', 'bitcast', 'convert') and inst.operands:
    inst = scope.get(inst.operands[0])
  return inst


def _constant(scope: dict, name: str) -> int | None:
  inst = _through_copies(scope, name)
  if inst is not None and inst.opcode == 'constant' and (m := _CONSTANT.search(inst.line)):
    return int(m.group(1))
  return None


def _added_constant(computations: dict, scope: dict, name: str) -> int | None:
  """c where `name` is x + c for a constant c: an add, or a fusion of one."""
  inst = _through_copies(scope, name)
  if inst is not None and inst.opcode == 'fusion':
    fused = _by_name(computations, dict(inst.callees()).get('calls', ''))
    root = next((i for i in fused.values() if i.root), None)
    if root is None or root.opcode != 'add':
      return None
    scope, inst = fused, root
  if inst is None or inst.opcode != 'add':
    return None
  found = [c for operand in inst.operands if (c := _constant(scope, operand)) is not None]
  return found[0] if len(found) == 1 else None


def _bound(computations: dict, condition: str) -> tuple[int, int] | None:
  """(c, 1 if ≤ else 0) of the condition's `i < c` or `i <= c` (in it, or in a fusion it calls)."""
  found = []
  names = [condition]
  while names:
    scope = _by_name(computations, names.pop())
    for inst in scope.values():
      names += [callee for kind, callee in inst.callees() if kind == 'calls']
      if inst.opcode == 'compare' and len(inst.operands) == 2:
        direction = (m.group(1) if (m := _DIRECTION.search(inst.line)) else '')
        left, right = (_constant(scope, o) for o in inst.operands)
        if right is not None and left is None and direction in ('LT', 'LE'):
          found.append((right, int(direction == 'LE')))
        elif left is not None and right is None and direction in ('GT', 'GE'):
          found.append((left, int(direction == 'GE')))
  return found[0] if len(found) == 1 else None


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
      n = (trips(inst, computations, name) or 1) if inst.opcode == 'while' else 1
      for kind, callee in inst.callees():
        factor = {'body': n, 'condition': n + 1}.get(kind, 1)
        if kind != 'to_apply':  # reductions' scalar computations: nothing to count
          visit(callee, count * factor)

  if entry is not None:
    visit(entry, 1)
  return computations, times, devices
