"""What GPUs measured, held against today's time model: the programs benchmarks/calibrate.py banked
(benchmarks/results/calibrate_<part>-<gpu>.programs.json.gz: each row's optimized HLO as the GPU
compiled it, and the kernels its profiled calls ran) re-predicted by planning/timing.py, per row
and per kernel class. `python -m benchmarks.calibrate --check` prints it; tests/test_timing.py
holds the fit to GOAL.

A kernel's class comes from its name in the profile (cuBLAS's nvjet kernels, XLA's Triton GEMM
fusions, cuDNN's, our Pallas kernels' flash_attention_*), a prediction's from the part the model
charged it to. The launch gap is what a call took beyond its kernels' sum: launches, and the host
between steps (a step row is timed waiting for each step)."""

import dataclasses
import glob
import gzip
import json
import os
import re

from planning import gpus, timing

CLASSES = ('gemm', 'attention cudnn', 'attention pallas', 'fusion', 'copy', 'collective',
           'launch gap')
# Predicted/measured ranges each kind of banked row must fall in (issue 50's goal): GEMMs of at
# least 4096³ and train steps; attention, every implementation, forward and forward+backward.
# Copies to and from host memory (the PCIe link, each way and both at once) likewise.
GOAL = {'gemm': (0.85, 1.18), 'step': (0.85, 1.18), 'attention': (0.8, 1.25), 'host': (0.8, 1.25)}


@dataclasses.dataclass
class Checked:
  file: str  # the bank's part and GPU: steps_1b-h200
  what: str  # the row (and ' fwd_bwd' for an attention row's forward+backward program)
  kind: str  # a GOAL key, or '' for a row no goal covers (small GEMMs, copies, xla attention)
  measured_s: float
  predicted_s: float
  classes: dict  # {class: (measured s, predicted s)} a call
  row: dict  # the banked row: a step's has its tokens/s a GPU and MFU as measured

  @property
  def ratio(self) -> float:
    """predicted / measured: below 1 the model is too fast."""
    return self.predicted_s / self.measured_s


def write_part(out_dir: str, part: str, name: str, figures: dict, programs: dict) -> None:
  """Banks a part's rows (`figures`) and their programs ({what: {'hlo', 'profile'}}) as
  out_dir/calibrate_<part>-<name>.json and .programs.json.gz."""
  os.makedirs(out_dir, exist_ok=True)
  with open(f'{out_dir}/calibrate_{part}-{name}.json', 'w') as f:
    f.write(json.dumps(figures, indent=2) + '\n')
  # mtime 0: the same programs give the same bytes, so git sees no change where there is none
  with gzip.GzipFile(f'{out_dir}/calibrate_{part}-{name}.programs.json.gz', 'wb', mtime=0) as f:
    f.write(json.dumps({'device': figures['device'], 'jax': figures['jax'],
                        'programs': programs}).encode())


def kernel_class(name: str) -> str:
  if name.startswith(('nvjet', 'gemm_fusion', 'cutlass')) or re.search('gemm|cublas', name):
    return 'gemm'
  if 'cudnn' in name:
    return 'attention cudnn'
  if name.startswith('flash_attention'):
    return 'attention pallas'
  if name.startswith(('memcpy', 'Memset')):
    return 'copy'
  if 'nccl' in name:
    return 'collective'
  return 'fusion'


def measured_classes(profile: dict, measured_s: float) -> dict:
  """{class: seconds a call} of a profile's device kernels, and the launch gap."""
  seconds = dict.fromkeys(CLASSES, 0.0)
  for event in profile['events']:
    if event['plane'].startswith('/device:') and event['line'].startswith('Stream'):
      seconds[kernel_class(event['name'])] += event['us'] / 1e6 / profile['calls']
  seconds['launch gap'] = max(0.0, measured_s - sum(seconds.values()))
  return seconds


def predicted_classes(step: timing.StepTime) -> dict:
  seconds = dict.fromkeys(CLASSES, 0.0)
  for k in step.kernels:
    cls = {'gemm': 'gemm', 'fusion': 'fusion', 'other': 'copy'}.get(
        k.part, f'attention {k.implementation}')
    seconds[cls] += k.seconds * k.runs
  seconds['collective'] = step.breakdown['communication']
  seconds['launch gap'] = step.breakdown['launch']
  return seconds


def kind_of(file: str, row: dict) -> str:
  if file.startswith('steps'):
    return 'step'
  if file.startswith('gemm') and min(row['m'], row['n'], row['k']) >= 4096:
    return 'gemm'
  if file.startswith('attention') and row.get('impl') in ('cudnn', 'pallas'):
    return 'attention'
  if file.startswith('host'):
    return 'host'
  return ''


def check(results_dir: str = 'benchmarks/results', parts: str = '*',
          only=None) -> list[Checked]:
  """Every banked program of a GPU in planning/gpus.py, re-predicted for that GPU; of the parts
  matching `parts` (a glob: 'steps_*'), and, given `only`, the programs `only(file, what)` keeps."""
  checked = []
  for path in sorted(glob.glob(f'{results_dir}/calibrate_{parts}.programs.json.gz')):
    file = os.path.basename(path).removeprefix('calibrate_').removesuffix('.programs.json.gz')
    gpu = gpus.find(file.rpartition('-')[2].upper())
    if gpu is None:  # a CPU's plumbing run
      continue
    rows = {r['what']: r for r in json.loads(
        open(path.removesuffix('.programs.json.gz') + '.json').read())['rows']}
    with gzip.open(path) as f:
      programs = json.load(f)['programs']
    for what, program in programs.items():
      if only and not only(file, what):
        continue
      # its row, and where in the row its measurement is: `… fwd_bwd` is row['fwd_bwd']
      row_what = max((r for r in rows if what == r or what.startswith(r + ' ')), key=len)
      row = timed = rows[row_what]
      for key in what.removeprefix(row_what).split():
        timed = timed[key]
      measured_s = timed['measured_s']
      step = timing.predict(program['hlo'], gpu)
      measured = measured_classes(program['profile'], measured_s)
      predicted = predicted_classes(step)
      checked.append(Checked(file, what, kind_of(file, row), measured_s, step.seconds,
                             {c: (measured[c], predicted[c]) for c in CLASSES}, row))
  return checked


def missing_goal(checked: list[Checked]) -> list[Checked]:
  return [c for c in checked if c.kind and not GOAL[c.kind][0] <= c.ratio <= GOAL[c.kind][1]]


def print_check(checked: list[Checked]) -> None:
  print(f'{"bank":<16}{"program":<58}{"measured":>10}{"predicted":>11}{"pred/meas":>10}  goal')
  for c in checked:
    goal = GOAL.get(c.kind)
    mark = '' if not goal else 'ok' if goal[0] <= c.ratio <= goal[1] else f'MISSES {goal}'
    print(f'{c.file:<16}{c.what[:57]:<58}{c.measured_s * 1e3:>8.3f}ms{c.predicted_s * 1e3:>9.3f}ms'
          f'{c.ratio:>10.2f}  {mark}')
  steps = [c for c in checked if c.kind == 'step']
  print(f'\ntrain steps{"":<56}{"measured":>22}{"predicted":>22}')
  print(f'{"":<67}{"tokens/s a GPU":>15}{"MFU":>7}{"tokens/s a GPU":>15}{"MFU":>7}')
  for c in steps:
    tokens, mfu = c.row['tokens_per_s_per_device'], c.row['mfu']
    print(f'{c.file.rpartition("-")[2]:<6}{c.what[:60]:<61}{tokens:>15,.0f}{mfu:>7.1%}'
          f'{tokens / c.ratio:>15,.0f}{mfu / c.ratio:>7.1%}')
  print('\nby kernel class, summed over the train steps (ms a step; predicted / measured):')
  for cls in CLASSES:
    measured = sum(c.classes[cls][0] for c in steps)
    predicted = sum(c.classes[cls][1] for c in steps)
    if measured or predicted:
      print(f'  {cls:<18}{measured * 1e3:>10.2f}{predicted * 1e3:>10.2f}'
            f'{predicted / measured if measured else float("inf"):>8.2f}')
