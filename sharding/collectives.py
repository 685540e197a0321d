"""The collectives a compiled program runs, read from its HLO text: each op once per execution.

A collective inside a `lax.scan` body (the layer stack) appears once in the text but runs once per
layer: each counts the runs of its computation (sharding/hlo.py's `runs`). Async pairs count once
(at their `-done`, whose result is the collective's; a `-start` also carries its operands).

An async pair whose -start and -done have compute scheduled between them (a fusion, a kernel, a
conditional or loop that launches them) is `overlapped`: its bytes move while the device works.
In a GPU program this is the latency-hiding scheduler's decision, read from the scheduled text.

Bytes are what each device sends per execution under the ring algorithms NCCL uses, for a group
of n devices: all-gather R·(n−1)/n of its result R; reduce-scatter r·(n−1) of its result r (its
operand is n·r); all-reduce 2·S·(n−1)/n; all-to-all S·(n−1)/n; collective-permute S. A group of
one moves nothing. A ragged all-to-all sends only the rows its sizes say, known at run time; its
operand and result are buffers for the most it can send and receive. It is counted as sending
the smaller of the two, its input rows (n−1)/n, what it sends when its rows spread evenly over the
group (an MoE layer's tokens over balanced experts, model/moe.py).
"""

import dataclasses
import functools
import math
import re

import numpy as np

from sharding import hlo

OPS = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'ragged-all-to-all',
       'collective-permute')
_GROUPS_IOTA = re.compile(r'replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?')
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:, device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))? \{([^}]*)\}")
_GROUPS_LIST = re.compile(r'replica_groups=\{((?:\{[0-9,]*\},?)*)\}')
_PAIRS = re.compile(r'source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}')
_COMPUTE = ('fusion', 'custom-call', 'conditional', 'while', 'call', 'dot', 'convolution')


@dataclasses.dataclass(frozen=True)
class Collective:
  op: str  # one of OPS
  arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each result
  group: int  # devices that take part together
  executions: int  # times one step runs it (trip counts of the loops around it)
  overlapped: bool = False  # async, with compute scheduled between its start and done
  devices: tuple[tuple[int, ...], ...] = ()  # its groups of device ids; (source, target) pairs
                                             # for a collective-permute
  operand: tuple[tuple[str, tuple[int, ...]], ...] = ()  # a ragged all-to-all's input, if known

  def crosses(self, part_of) -> bool:
    """Whether it moves data between devices that `part_of(device)` tells apart (a node, a
    pipeline stage)."""
    return any(len({part_of(d) for d in group}) > 1 for group in self.devices)

  @property
  def result_bytes(self) -> int:
    return hlo.nbytes(self.arrays)

  @property
  def sent_bytes(self) -> float:
    """Bytes each device sends per execution (the module docstring's ring model)."""
    n, size = self.group, self.result_bytes
    if n <= 1:
      return 0.0
    if self.op == 'ragged-all-to-all' and self.operand:
      size = min(size, hlo.nbytes(self.operand))
    return {'all-gather': size * (n - 1) / n, 'reduce-scatter': size * (n - 1),
            'all-reduce': 2 * size * (n - 1) / n, 'all-to-all': size * (n - 1) / n,
            'ragged-all-to-all': size * (n - 1) / n, 'collective-permute': size}[self.op]


def _op_of(name: str) -> str | None:
  """The collective an instruction opcode counts as (at its -done for async pairs), else None."""
  if name in OPS:
    return name
  if name.endswith('-done') and name.removesuffix('-done') in OPS:
    return name.removesuffix('-done')
  return None


def _iota(dims: str, perm: str | None):
  """XLA's iota device list [dims]T(perm), flat."""
  ids = np.arange(math.prod(int(d) for d in dims.split(','))).reshape(
      [int(d) for d in dims.split(',')])
  return (ids.transpose([int(d) for d in perm.split(',')]) if perm else ids).reshape(-1)


def _device_groups(line: str, devices: int) -> tuple[tuple[int, ...], ...]:
  """The device ids of each group (or source-target pair) a collective's line names."""
  if m := _PAIRS.search(line):
    return tuple(tuple(map(int, pair)) for pair in re.findall(r'\{(\d+),(\d+)\}', m.group(1)))
  if m := _GROUPS_MESH.search(line):  # mesh[axes], device_ids=(iota) {the group's axes}
    sizes = dict((name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    ids = _iota(m.group(2), m.group(3)) if m.group(2) else np.arange(math.prod(sizes.values()))
    ids = ids.reshape(tuple(sizes.values()))
    names = [n for n in re.findall(r"'(\w+)'", m.group(4)) if n in sizes]
    order = [n for n in sizes if n not in names] + names  # the group's axes last
    ids = ids.transpose([list(sizes).index(n) for n in order])
    return tuple(map(tuple, ids.reshape(-1, math.prod(sizes[n] for n in names)).tolist()))
  if m := _GROUPS_IOTA.search(line):  # [groups, size]<=[dims]T(perm)
    shape = [int(d) for d in m.group(1).split(',')]
    return tuple(map(tuple, _iota(m.group(2), m.group(3)).reshape(shape).tolist()))
  if (m := _GROUPS_LIST.search(line)) and m.group(1):
    return tuple(tuple(map(int, g.split(','))) for g in re.findall(r'\{([0-9,]+)\}', m.group(1)))
  return (tuple(range(devices)),)


def in_computation(lines: list[str], devices: int, executions: int = 1):
  """[(index of its start, index of its done, Collective)] for the collectives of one
  computation's instruction lines, in program order of their done (a synchronous collective's
  start and done are its own line; an async -done whose -start is not in these lines, one a loop
  started in its previous iteration, has its own index as its start)."""
  instructions = [hlo.instruction(line) for line in lines]
  position = {inst.name: i for i, inst in enumerate(instructions) if inst}
  found = []
  for i, inst in enumerate(instructions):
    if inst and (op := _op_of(inst.opcode)):
      begin, overlapped = i, False
      if inst.opcode.endswith('-done'):  # its groups are written on its -start
        begin = position.get(inst.operands[0], i)
        overlapped = any(between and between.opcode in _COMPUTE
                         for between in instructions[begin + 1:i])
      groups = _device_groups(lines[begin], devices)
      size = devices if op == 'collective-permute' else len(groups[0])
      # An async start's type lists its operands, the input first, then its result; a
      # synchronous one's input is the instruction that makes its first operand.
      operand = instructions[begin].arrays[:1] if begin != i else ()
      if not operand and (source := position.get(inst.operands[0])) is not None:
        operand = instructions[source].arrays[:1]
      found.append((begin, i, Collective(op, inst.arrays, size, executions, overlapped, groups,
                                         operand)))
  return found


@functools.lru_cache(maxsize=4)  # a plan asks of one program several times (summary, crossing)
def executed(hlo_text: str) -> tuple[Collective, ...]:
  """Every collective of the program, with how many times one execution of it runs each."""
  computations, times, devices = hlo.runs(hlo_text)
  return tuple(c for name, count in times.items()
               for _, _, c in in_computation(computations.get(name, []), devices, count))


def summary(hlo_text: str) -> dict[str, dict]:
  """{op: {'count': executions per step, 'bytes': bytes each device sends per step,
  'overlapped_bytes': those of them sent while computing, 'by_dtype': {dtype: bytes}}} for the
  ops the program runs."""
  out = {}
  for c in executed(hlo_text):
    entry = out.setdefault(c.op, {'count': 0, 'bytes': 0, 'overlapped_bytes': 0, 'by_dtype': {}})
    entry['count'] += c.executions
    sent = c.sent_bytes * c.executions
    entry['bytes'] += round(sent)
    entry['overlapped_bytes'] += round(sent) if c.overlapped else 0
    dtype = '+'.join(sorted({dt for dt, _ in c.arrays}))
    entry['by_dtype'][dtype] = entry['by_dtype'].get(dtype, 0) + round(sent)
  return out


def total_bytes(hlo_text: str) -> int:
  """Bytes each device sends per step, over every collective."""
  return sum(entry['bytes'] for entry in summary(hlo_text).values())


def crossing_bytes(hlo_text: str, part_of) -> int:
  """Bytes each device sends per step in the collectives whose devices `part_of(device id)` tells
  apart (a node's: they go over its network)."""
  return round(sum(c.sent_bytes * c.executions for c in executed(hlo_text) if c.crosses(part_of)))


def shapes(hlo_text: str, op: str) -> list[tuple[int, ...]]:
  """Result shapes of every `op` (e.g. 'all-gather') in the program, once each."""
  return [shape for c in executed(hlo_text) if c.op == op for _, shape in c.arrays]
