"""What Muon costs a preset's step against AdamW's, in its plain form and in the round-robin form:
each planned as a user would (`python train.py ... --config.dry_run=True
--config.plan.target=H100`), compiled for H100s that are not here (planning/gpu_compiler.py).
Memory, FLOPs and collectives are the compiled programs'; a step time is the time model's
prediction, never a measurement.

  python -m benchmarks.muon --out=benchmarks/results/muon-h100-deviceless.json
  python -m benchmarks.muon --preset=configs/qwen3.py:8b   # another preset, over its devices

The forms (config.optimizer): `as_params` in float32 is optax's Muon left to XLA (each matrix's
Newton–Schulz partitioned over its FSDP shards: operands gathered and partial sums all-reduced in
every iteration); `round_robin` moves each stacked matrix whole onto one device (all-to-alls, a
mesh axis at a time), orthogonalises there and sends the result back, in float32 or bfloat16
(the default). The goal: the default adds at most 5% to AdamW's predicted step and 1 GiB to its
memory a GPU.
"""

import argparse

from benchmarks import plans, report
from planning.plan import readable_bytes

FORMS = {  # name: the optimizer's flags
    'adamw': ('--config.optimizer.name=adamw',),
    'muon as_params fp32': ('--config.optimizer.name=muon',
                            '--config.optimizer.muon_layout=as_params',
                            '--config.optimizer.muon_ns_dtype=float32'),
    'muon round_robin fp32': ('--config.optimizer.name=muon',
                              '--config.optimizer.muon_ns_dtype=float32'),
    'muon round_robin bf16': ('--config.optimizer.name=muon',),
}
GOAL = {'step_share': 0.05, 'memory_bytes': 2 ** 30}  # the default Muon's most over AdamW's


def figures(plan: dict) -> dict:
  ops = plan['collectives']
  return {'step_s': plan['time']['seconds'], 'total_bytes': plan['total_bytes'],
          'temp_bytes': plan['temp_bytes'], 'optimizer_bytes': plan['optimizer_bytes'],
          'matmul_flops': plan['matmul_flops'], 'newton_schulz': plan['newton_schulz'],
          'collective_bytes': {op: ops[op]['bytes'] for op in sorted(ops)},
          'exposed_communication_s': plan['time']['breakdown']['communication']['s'],
          'command': plan['command']}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--preset', default='configs/llama.py:8b')
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--out', default='', help='also write the figures here (JSON)')
  args = parser.parse_args(argv)
  base = (f'--config={args.preset}', f'--config.plan.devices={args.devices}')
  rows = {name: figures(plans.planned((*base, *flags))) for name, flags in FORMS.items()}
  adamw = rows['adamw']
  for r in rows.values():
    r['step_over_adamw'] = r['step_s'] / adamw['step_s'] - 1
    r['memory_over_adamw'] = r['total_bytes'] - adamw['total_bytes']
    r['matmul_flops_over_adamw'] = r['matmul_flops'] - adamw['matmul_flops']
  print(f'{args.preset} over {args.devices} H100s (deviceless; steps predicted by the time model)')
  print(f'{"optimizer":<23}{"step":>8}{"vs AdamW":>10}{"a GPU":>11}{"vs AdamW":>11}'
        f'{"+GEMM TFLOP":>12}{"all-to-all":>11}{"all-gather":>11}{"all-reduce":>11}')
  for name, r in rows.items():
    c = r['collective_bytes']
    print(f'{name:<23}{r["step_s"]:>7.3f}s{r["step_over_adamw"]:>+10.1%}'
          f'{readable_bytes(r["total_bytes"]):>11}{r["memory_over_adamw"] / 2 ** 30:>+10.2f}G'
          f'{r["matmul_flops_over_adamw"] / 1e12:>12.1f}'
          + ''.join(f'{readable_bytes(c.get(op, 0)):>11}'
                    for op in ('all-to-all', 'all-gather', 'all-reduce')))
  default = rows['muon round_robin bf16']
  met = (default['step_over_adamw'] <= GOAL['step_share']
         and default['memory_over_adamw'] <= GOAL['memory_bytes'])
  print(f'goal (default Muon ≤ +{GOAL["step_share"]:.0%} step, ≤ +1 GiB a GPU): '
        f'{"met" if met else "not met"}')
  report.emit({'benchmark': 'muon', 'preset': args.preset, 'devices': args.devices,
               'forms': rows, 'goal': GOAL, 'goal_met': met, 'command': report.command()},
              args.out or None)


if __name__ == '__main__':
  main()
