"""Muon against AdamW on the default run (configs/default.py: the byte-level Llama on the
stdlib's Python), at equal steps and tokens, each optimizer's learning rate swept over the same
values; the loss curves and validation losses measured on this machine's CPU.

  python -m benchmarks.optimizers --out=benchmarks/results/muon_vs_adamw-cpu.json
  python -m benchmarks.optimizers --muon_rates=4e-3,8e-3,1.6e-2 --only=muon --out=…  # Muon's
      # sweep again, AdamW's runs as banked

Muon scales each matrix's update to AdamW's RMS (muon_rms, Moonlight's), so AdamW's learning
rate and weight decay carry over as a start; each optimizer's rates are swept around its own
best (the embedding, head and norms take AdamW in both, at the run's rate). The goal: Muon's
best validation loss below AdamW's best.
"""

import argparse
import json
import pathlib
import tempfile

from benchmarks import report
from configs import default
from training import loop

OPTIMIZERS = ('adamw', 'muon')


def trained(name: str, rate: float, steps: int, workdir: str) -> dict:
  """One run of the default config with `name` at peak `rate`: its logged train losses and its
  validation losses (every eval_every steps and at the end)."""
  c = default.get_config()
  c.workdir, c.train_steps = workdir, steps
  c.eval_every, c.checkpoint_every = steps // 2, steps
  c.optimizer.update(name=name, learning_rate=rate)
  curve, evals = [], []
  for record in loop.run(c):
    if 'loss' in record:
      curve.append([int(record['step']), float(record['loss'])])
    if 'eval_loss' in record:
      evals.append([int(record['step']), float(record['eval_loss'])])
  return {'train': curve, 'eval': evals, 'final_eval_loss': evals[-1][1]}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--adamw_rates', default='1e-3,2e-3,4e-3', help="AdamW's peak rates")
  parser.add_argument('--muon_rates', default='1e-3,2e-3,4e-3', help="Muon's peak rates")
  parser.add_argument('--only', default='', help='run only this optimizer, the other as banked')
  parser.add_argument('--steps', type=int, default=default.get_config().train_steps)
  parser.add_argument('--out', default='', help='also write the figures here (JSON)')
  args = parser.parse_args(argv)
  rates = {'adamw': [float(r) for r in args.adamw_rates.split(',')],
           'muon': [float(r) for r in args.muon_rates.split(',')]}
  runs = {}
  if args.only and args.out and pathlib.Path(args.out).exists():  # the other's as banked
    banked = json.loads(pathlib.Path(args.out).read_text())
    runs = {key: r for key, r in banked['runs'].items() if r['optimizer'] != args.only}
    rates = {name: rates[name] if name == args.only else
             [r['learning_rate'] for r in runs.values() if r['optimizer'] == name]
             for name in OPTIMIZERS}
  for name in OPTIMIZERS:
    if args.only and name != args.only:
      continue
    for rate in rates[name]:
      with tempfile.TemporaryDirectory() as workdir:
        runs[f'{name} lr={rate:g}'] = {'optimizer': name, 'learning_rate': rate,
                                       **trained(name, rate, args.steps, workdir)}
  best = {name: min((r for r in runs.values() if r['optimizer'] == name),
                    key=lambda r: r['final_eval_loss']) for name in OPTIMIZERS}
  print(f'the default run, {args.steps} steps, measured on this CPU')
  print(f'{"run":<18}{"train loss":>11}{"eval loss":>11}')
  for key, r in runs.items():
    mark = ' best' if r is best[r['optimizer']] else ''
    print(f'{key:<18}{r["train"][-1][1]:>11.4f}{r["final_eval_loss"]:>11.4f}{mark}')
  met = best['muon']['final_eval_loss'] < best['adamw']['final_eval_loss']
  print(f'goal (Muon\'s best eval loss below AdamW\'s best): {"met" if met else "not met"}')
  command = report.command().replace(f' --only={args.only}', '') if args.out else report.command()
  report.emit({'benchmark': 'optimizers', 'steps': args.steps, 'rates': rates, 'runs': runs,
               'best': {name: f'{name} lr={r["learning_rate"]:g}' for name, r in best.items()},
               'goal_met': met, 'command': command}, args.out or None)


if __name__ == '__main__':
  main()
