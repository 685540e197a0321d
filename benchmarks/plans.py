"""The dry runs the docs quote: each a preset planned as a user would plan it (`python train.py
... --config.dry_run=True --config.plan.target=H100`), compiled for H100s that are not here
(planning/gpu_compiler.py), its plan kept. Memory is the compiled program's; a step time is the
time model's prediction of it, never a measurement.

  python -m benchmarks.plans --out=benchmarks/results/plans-h100-deviceless.json
  python -m benchmarks.plans --only=finetune_1b   # the plans of PLANS whose name has this
  python -m benchmarks.plans --only=finetune_1b --out=…   # those replaced, the others kept
"""

import argparse
import json
import pathlib
import subprocess
import sys

from benchmarks import report
from planning.plan import readable_bytes

DRY = ('--config.dry_run=True', '--config.plan.target=H100')
PLANS = {  # name: the flags after train.py (its dry run's own)
    'llama_1b': ('--config=configs/llama.py:1b',),
    'finetune_8b_lora': ('--config=configs/finetune.py:8b',),
    'finetune_8b_full': ('--config=configs/finetune.py:8b', '--config.model.lora_rank=0'),
    'finetune_1b_lora': ('--config=configs/finetune.py:1b',),
    'dpo_8b_lora_8gpu': ('--config=configs/dpo.py:8b', '--config.plan.devices=8'),
    'llama_1b_8gpu': ('--config=configs/llama.py:1b', '--config.plan.devices=8'),
    'llama_1b_8gpu_b64': ('--config=configs/llama.py:1b', '--config.batch_size=64',
                          '--config.plan.devices=8'),
    'qwen3_0.6b': ('--config=configs/qwen3.py:0.6b',),
    'qwen3_8b_8gpu': ('--config=configs/qwen3.py:8b', '--config.plan.devices=8'),
    'qwen3_32b_8gpu': ('--config=configs/qwen3.py:32b', '--config.plan.devices=8'),
    'finetune_qwen3_8b_lora': ('--config=configs/finetune.py:qwen3-8b',),
    'gemma3_1b': ('--config=configs/gemma3.py:1b',),
    'gemma3_4b_8gpu': ('--config=configs/gemma3.py:4b', '--config.plan.devices=8'),
    'gemma3_27b_8gpu': ('--config=configs/gemma3.py:27b', '--config.plan.devices=8'),
    'finetune_gemma3_4b_lora': ('--config=configs/finetune.py:gemma3-4b',),
}


def planned(flags: tuple[str, ...]) -> dict:
  """The plan train.py's dry run prints as its last line, without the time model's kernel list
  (the costliest kernels: the console's, not the docs')."""
  command = [sys.executable, 'train.py', *flags, *DRY]
  done = subprocess.run(command, text=True, capture_output=True)
  if done.returncode:
    raise SystemExit(f'{" ".join(command[1:])} failed (exit {done.returncode}): '
                     f'{done.stderr.strip().splitlines()[-1:]}')
  plan = json.loads(done.stdout.strip().splitlines()[-1])
  if plan.get('time'):
    plan['time'].pop('kernels', None)
  return {'command': ' '.join(['python', *command[1:]]), **plan}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='the plans whose name contains this')
  parser.add_argument('--out', default='', help='also write the figures here (JSON)')
  args = parser.parse_args(argv)
  plans = {name: planned(flags) for name, flags in PLANS.items() if args.only in name}
  if args.only and args.out and pathlib.Path(args.out).exists():  # the others as banked
    plans = {**json.loads(pathlib.Path(args.out).read_text())['plans'], **plans}
  print(f'{"plan":<20} {"devices":>7} {"total a device":>15} {"fits":>5} {"step (predicted)":>17}'
        f' {"MFU":>6}')
  for name, p in plans.items():
    time = p['time'] or {}
    print(f'{name:<20} {p["n_devices"]:>7} {readable_bytes(p["total_bytes"]):>15} '
          f'{str(p["fits"]):>5} {time.get("seconds", float("nan")):>16.3f}s '
          f'{time.get("mfu", float("nan")):>6.1%}')
  command = report.command().replace(f' --only={args.only}', '') if args.out else report.command()
  report.emit({'benchmark': 'plans', 'plans': plans, 'command': command}, args.out or None)


if __name__ == '__main__':
  main()
