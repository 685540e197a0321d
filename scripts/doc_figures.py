"""The figures the docs show, generated from benchmarks/results/: each a block of a page between
`<!-- figures: NAME -->` and `<!-- /figures -->`, rendered by the function of that name here.
tests/test_structure.py fails when a block differs from what its results render.

  python scripts/doc_figures.py           # rewrite every block from the results
  python scripts/doc_figures.py --check   # exit 1 naming each stale block
"""

import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import json  # noqa: E402

from benchmarks import bank  # noqa: E402  (after the repository is on the path)
from planning.plan import readable_seconds  # noqa: E402
PAGES = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]
BLOCK = re.compile(r'(<!-- figures: (\w+) -->\n)(.*?)(<!-- /figures -->)', re.S)

ATTENTION = {'cudnn': 'cuDNN', 'pallas': 'ours (`pallas`)'}
PRECISION = {'default': 'bf16', 'fp8': 'fp8 projections'}
# The README's speed table: each preset as it ships, on the GPUs that measured it.
SPEED = [('125m', 'cudnn', 'default'), ('1b', 'cudnn', 'default'), ('1b', 'cudnn', 'fp8'),
         ('1b', 'pallas', 'default')]


def speed() -> str:
  """Each preset's train step as measured (benchmarks/results/calibrate_steps_*.json) beside
  today's time model's prediction of the same banked program (benchmarks/bank.py)."""
  wanted = {(f'steps_{preset}-{gpu}', f'configs/llama.py:{preset} {attention} {precision}')
            for preset, attention, precision in SPEED for gpu in ('h200', 'h100')}
  checked = {(c.file, c.what): c for c in bank.check(parts='steps_*',
                                                     only=lambda *key: key in wanted)}
  rows = ['| preset | GPU | attention, precision | step, measured | tokens/s a GPU | MFU | '
          'step, predicted |', '| --- | --- | --- | --- | --- | --- | --- |']
  for preset, attention, precision in SPEED:
    for gpu in ('h200', 'h100'):
      c = checked[(f'steps_{preset}-{gpu}', f'configs/llama.py:{preset} {attention} {precision}')]
      rows.append(f'| {preset} | {gpu.upper()} | {ATTENTION[attention]}, {PRECISION[precision]} '
                  f'| {c.measured_s * 1e3:.1f} ms | {c.row["tokens_per_s_per_device"]:,.0f} | '
                  f'{c.row["mfu"]:.1%} | {c.predicted_s * 1e3:.1f} ms |')
  return '\n'.join(rows) + '\n'


def plan_8b() -> str:
  """The 8b preset's dry run on 8 H100s as its console shows it, from the plan the side-by-side
  benchmark banked (benchmarks/results/peers-h100-deviceless.json: meshlm's row)."""
  peers = json.loads((REPO / 'benchmarks/results/peers-h100-deviceless.json').read_text())
  plan = next(p for p in peers['presets'] if p['preset'] == '8b')['meshlm']
  step = plan['step_s']
  parts = [('GEMMs', plan['gemm_s']), ('attention', plan['attention_s']),
           ('other fusions', plan['fusion_s']), ('other, launches', plan['rest_s']),
           ('exposed communication', plan['exposed_communication_s'])]
  lines = [f'{"step time (predicted)":<25}{readable_seconds(step)}, '
           f'{plan["tokens_per_s_per_gpu"]:,.0f} tokens/s a device, MFU {plan["mfu"]:.1%}: the '
           'time model of this program on H100, not a measurement']
  lines += [f'{"  " + name:<25}{readable_seconds(s)} ({s / step:.0%})' for name, s in parts]
  return '```\n' + '\n'.join(lines) + '\n  …\n```\n'


# Each preset of the side-by-side table, as its row names it (what the results do not record).
PEERS = {
    '8b': "8b (8), 32 × 8192, dots_except_out, 4 microbatches, layers unrolled, the head 1024 "
          "tokens at a time, XLA's scheduler within 67%",
    '1b': '1b (1), 8 × 4096, dots_attention_except_out, layers unrolled, the head 2048 tokens at '
          'a time',
    '70b': '70b (32), 32 × 8192, full, weights a layer early',
    'mixtral-8x7b': 'Mixtral-8x7B (16), 16 × 4096, full, fsdp=16',
    'mixtral-8x7b-ep8': "Mixtral-8x7B (16), experts over 8 (fsdp=2 × expert=8, meshlm's plan)",
}


def peers() -> str:
  """meshlm and MaxText, each preset compiled by both for the same deviceless H100s and read by
  the time model (benchmarks/results/peers-h100-deviceless.json, `python -m benchmarks.peers`)."""
  results = json.loads((REPO / 'benchmarks/results/peers-h100-deviceless.json').read_text())
  rows = ['| preset (H100s) | system | memory | step | tokens/s a GPU | MFU | GEMM | attention | '
          'other fusions | exposed comm. | reduce-scatter |',
          '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for preset in results['presets']:
    for system in ('meshlm', 'MaxText'):
      plan = preset[system]
      scatter = plan['collectives'].get('reduce-scatter')
      scattered = (f'{scatter["bytes"] / 2**30:.1f} GiB '
                   f'({max(scatter["by_dtype"], key=scatter["by_dtype"].get)})' if scatter
                   else '—')
      exposed = f'{plan["exposed_communication_s"]:.3f}' if preset['gpus'] > 1 else '—'
      name = f' {PEERS[preset["preset"]]} ' if system == 'meshlm' else ' '
      rows.append(f'|{name}| {system} | {plan["total_bytes"] / 2**30:.2f} GiB | '
                  f'{plan["step_s"]:.3f} s | {plan["tokens_per_s_per_gpu"]:,.0f} | '
                  f'{plan["mfu"]:.1%} | {plan["gemm_s"]:.3f} | {plan["attention_s"]:.3f} | '
                  f'{plan["fusion_s"]:.3f} | {exposed} | {scattered} |')
  return '\n'.join(rows) + '\n'


RENDERERS = {'speed': speed, 'plan_8b': plan_8b, 'peers': peers}


def refreshed(text: str, rendered: dict) -> str:
  """`text` with each block's body replaced by what its renderer gives (`rendered`, cached)."""
  def body(match):
    name = match.group(2)
    if name not in RENDERERS:
      raise ValueError(f'<!-- figures: {name} --> names no renderer of scripts/doc_figures.py')
    if name not in rendered:
      rendered[name] = RENDERERS[name]()
    return match.group(1) + rendered[name] + match.group(4)
  return BLOCK.sub(body, text)


def stale() -> list[str]:
  """The pages whose blocks differ from what the results render."""
  rendered = {}
  return [str(page.relative_to(REPO)) for page in PAGES
          if refreshed(page.read_text(), rendered) != page.read_text()]


def main(argv) -> int:
  if '--check' in argv:
    if pages := stale():
      print(f'stale figures in {", ".join(pages)}: run python scripts/doc_figures.py')
      return 1
    return 0
  rendered = {}
  for page in PAGES:
    text = page.read_text()
    if (new := refreshed(text, rendered)) != text:
      page.write_text(new)
      print(f'rewrote {page.relative_to(REPO)}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
