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
  peers = result('peers-h100-deviceless')
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
    '8b': '8b (8), 32 × 8192, dots_attention, 4 microbatches, layers unrolled, the head 1024 '
          'tokens at a time',
    '1b': '1b (1), 8 × 4096, dots_attention_except_out, layers unrolled, the head 2048 tokens at '
          'a time',
    '70b': '70b (32), 32 × 8192, full, weights a layer early',
    'mixtral-8x7b': 'Mixtral-8x7B (16), 16 × 4096, full, fsdp=16',
    'mixtral-8x7b-ep8': "Mixtral-8x7B (16), experts over 8 (fsdp=2 × expert=8, meshlm's plan)",
}


def peers() -> str:
  """meshlm and MaxText, each preset compiled by both for the same deviceless H100s and read by
  the time model (benchmarks/results/peers-h100-deviceless.json, `python -m benchmarks.peers`)."""
  results = result('peers-h100-deviceless')
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


# The runs of `python -m benchmarks.peers --search` the best-against-best table shows, in order
PEERS_BEST = ['peers_best-h100-deviceless']


def peers_best() -> str:
  """Best against best: each system's fastest configuration that fits and its curve of step
  against memory (benchmarks/results/PEERS_BEST, `--search`)."""
  runs = [result(name) for name in PEERS_BEST]
  assert len({r['memory_bytes'] for r in runs}) == 1, 'PEERS_BEST judged fits at other memories'
  results = {'memory_bytes': runs[0]['memory_bytes'],
             'presets': [p for r in runs for p in r['presets']]}
  fits = results['memory_bytes'] / 2**30
  rows = ['| preset (H100s) | system | fastest that fits | memory | step | the curve: GiB a GPU → '
          'step (s), each point faster than all that need less |', '| --- | --- | --- | --- | --- | --- |']
  ratios = []
  for preset in results['presets']:
    for system in ('meshlm', 'MaxText'):
      found = preset[system]
      fastest = found['candidates'][found['best']] if found['best'] is not None else None
      curve = ', '.join(f'{r["total_bytes"] / 2**30:.1f} → {r["step_s"]:.3f}'
                        + ('' if r['fits'] else ' (does not fit)')
                        for r in (found['candidates'][i] for i in found['front']))
      name = (f' {preset["preset"]} ({preset["gpus"]}), {preset["batch_size"]} × '
              f'{preset["seq_len"]}, {preset["microbatches"]} microbatch'
              f'{"es" if preset["microbatches"] > 1 else ""} ' if system == 'meshlm' else ' ')
      best = (f'{fastest["label"]} | {fastest["total_bytes"] / 2**30:.2f} GiB | '
              f'{fastest["step_s"]:.3f} s' if fastest else 'nothing fits | — | —')
      rows.append(f'|{name}| {system} | {best} | {curve} |')
    if 'step_ratio' in preset:
      ratios.append(best_against_best(preset))
  return ('\n'.join(rows) + f'\n\nPredicted, each fitting the {fits:.2f} GiB JAX takes of an H100. '
          + ' '.join(ratios) + '\n')


def best_against_best(preset: dict) -> str:
  """One preset's comparison: the fastest of each that fits, then both within the memory the
  leaner of the two needs (each system's fastest candidate that needs no more)."""
  best = {system: preset[system]['candidates'][preset[system]['best']]
          for system in ('meshlm', 'MaxText')}
  leaner = min(best, key=lambda system: best[system]['total_bytes'])
  within = best[leaner]['total_bytes']
  fastest = {system: min((r for r in preset[system]['candidates']
                          if 'error' not in r and r['total_bytes'] <= within),
                         key=lambda r: r['step_s']) for system in best}
  return (f'On the {preset["preset"]}, meshlm\'s fastest step is {preset["step_ratio"]:.3f}× '
          f'MaxText\'s fastest; within the {within / 2**30:.2f} GiB {leaner}\'s fastest needs, '
          f'{fastest["meshlm"]["step_s"] / fastest["MaxText"]["step_s"]:.3f}× '
          f'(meshlm {fastest["meshlm"]["label"]}, MaxText {fastest["MaxText"]["label"]}).')


def efficiencies() -> str:
  """The time model's constants as planning/gpus.py and planning/offload.py hold them, each with
  the measurements (or the prior) it stands for."""
  from planning import gpus, offload
  h100 = gpus.GPUS['H100']
  tflops = lambda kernel, k: [v for by_keys in gpus.ATTENTION_TFLOPS[kernel].values()
                              for pair in by_keys.values() for v in (pair[k],)]
  span = lambda kernel, k: f'{min(tflops(kernel, k)):.0f}–{max(tflops(kernel, k)):.0f}'
  rows = [
      ('`GEMM_EFFICIENCY`', f'{gpus.GEMM_EFFICIENCY} of the bf16 peak, at full waves of '
       f'{gpus.GEMM_TILE[0]}×{gpus.GEMM_TILE[1]} output tiles',
       "cuBLAS GEMMs of at least 4096³ on the H100 and the H200 (`calibrate_gemm-*`): their "
       'geometric mean'),
      ('`FP8_GEMM_EFFICIENCY`', f'{gpus.FP8_GEMM_EFFICIENCY} of the fp8 peak',
       'the same GEMMs in fp8, the scaling kernels of each program charged beside them'),
      ('`HBM_EFFICIENCY`', f'{gpus.HBM_EFFICIENCY} of the bandwidth',
       "XLA's element-wise passes on the H200 (`calibrate_copy-h200`)"),
      ('`ASYNC_COPY_EFFICIENCY`', f'{gpus.ASYNC_COPY_EFFICIENCY} of the bandwidth',
       "the memcpy kernels that move a scanned layer's slices of its stacked arrays, in the banked "
       'scanned steps'),
      ('`ATTENTION_TFLOPS`', f'cuDNN {span("cudnn", 0)} TFLOP/s forward, {span("cudnn", 1)} '
       f'backward; ours {span("pallas", 0)} and {span("pallas", 1)}; ours in Mosaic GPU '
       '(`hopper`): ours in Triton\'s, a prior until measured',
       'the mean of the H100\'s and the H200\'s measurements by kernel, head dim and keys '
       '(`calibrate_attention-*`), geometric between lengths'),
      ('`ATTENTION_LENGTH_FACTOR`', ', '.join(f'{v} at {k} keys' for k, v in
                                            gpus.ATTENTION_LENGTH_FACTOR.items()),
       "below the shortest measured keys: the FlashAttention-3 paper's non-causal sweep"),
      ('`CUDNN_BIAS_SLOWDOWN`', f'{gpus.CUDNN_BIAS_SLOWDOWN[0]} forward, '
       f'{gpus.CUDNN_BIAS_SLOWDOWN[1]} backward',
       "cuDNN's kernels with the document mask as a dense bias against without it, in the "
       "banked steps' kernel profiles"),
      ('`PALLAS_SEGMENT_SLOWDOWN`', ', '.join(f'{v} {k}' for k, v in
                                            gpus.PALLAS_SEGMENT_SLOWDOWN.items()),
       "our kernels with segment ids against without, one document a row, in the H100's banked "
       'steps'),
      ('`GROUPED_GEMM_EFFICIENCY`', f'{gpus.GROUPED_GEMM_EFFICIENCY:.3f} of the bf16 peak',
       "a prior: JAX's Pallas Triton attention forward's published share, until "
       '`benchmarks/moe.py --measure` times our grouped matmul'),
      ('`LINK_EFFICIENCY`, `NETWORK_EFFICIENCY`', f'{gpus.LINK_EFFICIENCY} of NVLink, '
       f'{gpus.NETWORK_EFFICIENCY} of the NIC', 'nccl-tests bus bandwidth on 8 × H100; a prior, '
       'since one GPU cannot measure it'),
      ('`LINK_LATENCY_S`, `NETWORK_LATENCY_S`', f'{gpus.LINK_LATENCY_S * 1e6:.0f} µs, '
       f'{gpus.NETWORK_LATENCY_S * 1e6:.0f} µs', 'a prior'),
      ('`GPU.host_bandwidth`, `host_duplex_bandwidth`', f'H100: {h100.host_bandwidth / 1e9:.0f} '
       f'GB/s each way, {h100.host_duplex_bandwidth / 1e9:.0f} GB/s the two ways together',
       "the H100 copying to and from pinned host memory inside one program (calibrate's `host` "
       'part); a copy that overlaps the other way\'s moves at half the duplex rate'),
      ('`offload.NVME_BANDWIDTH`', f'{offload.NVME_BANDWIDTH / 1e9:.0f} GB/s a node, reads and '
       'writes sharing it', "a DGX node's RAID of local NVMe (ZeRO-Infinity); a prior: "
       '`python -m benchmarks.nvme --dir=DIR` measures a drive'),
      ('`KERNEL_LAUNCH_S`', f'{gpus.KERNEL_LAUNCH_S * 1e6:.1f} µs',
       "the banked steps' time beyond their kernels' sum, a launch"),
  ]
  return '\n'.join(['| constant | value | fitted to |', '| --- | --- | --- |',
                    *(f'| {name} | {value} | {source} |' for name, value, source in rows)]) + '\n'


def result(name: str) -> dict:
  return json.loads((REPO / 'benchmarks' / 'results' / f'{name}.json').read_text())


def planned(name: str) -> dict:
  """One dry run of benchmarks/plans.py's (benchmarks/results/plans-h100-deviceless.json)."""
  return result('plans-h100-deviceless')['plans'][name]


def gib(n: float) -> str:
  return f'{n / 2**30:.2f} GiB'


def predicted(plan: dict) -> str:
  return f'{readable_seconds(plan["time"]["seconds"])} (MFU {plan["time"]["mfu"]:.1%})'


def tokens(plan: dict) -> int:
  """The tokens of a planned step (the plan keeps its rate and time, not the batch)."""
  time = plan['time']
  return round(time['tokens_per_s_per_device'] * time['seconds'] * plan['n_devices'])


def plan_1b() -> str:
  """The README's 1b dry run on one H100 (benchmarks/plans.py), a paragraph."""
  p = planned('llama_1b')
  return (f'The 1b\'s dry run above plans {gib(p["total_bytes"])} of the '
          f'{gib(p["memory_bytes"])} JAX takes of the H100, and a step of {predicted(p)}, the '
          'time model\'s prediction.\n')


def finetune_8b() -> str:
  """The 8b fine-tuned whole and with LoRA on one H100, planned (benchmarks/plans.py)."""
  full, lora = planned('finetune_8b_full'), planned('finetune_8b_lora')
  fits = lambda p: f'yes, of {gib(p["memory_bytes"])}' if p['fits'] else 'no'
  rows = [f'| 8b, 1 H100, batch {tokens(lora) // 4096} × 4096, {lora["remat_policy"]}, '
          f'{lora["microbatches"]} microbatches | parameters | optimizer state | total | fits | '
          'step (predicted) |', '| --- | --- | --- | --- | --- | --- |']
  for name, p, kind in (('full fine-tuning (`lora_rank=0`)', full, 'fp32'),
                        ('LoRA r=16', lora, 'bf16 base, fp32 adapters')):
    rows.append(f'| {name} | {gib(p["param_bytes"])} ({kind}) | {gib(p["optimizer_bytes"])} | '
                f'{gib(p["total_bytes"])} | {fits(p)} | {predicted(p)} |')
  return '\n'.join(rows) + '\n'


def finetune_1b() -> str:
  """The 1b preset's shapes with LoRA on one H100 (benchmarks/plans.py), a paragraph."""
  p = planned('finetune_1b_lora')
  batch = tokens(p) // 4096
  return (f'Llama-3.2-1B\'s shapes fine-tune on one H100 the same way, `configs/finetune.py:1b` '
          f'(batch {batch} × 4096, `{p["remat_policy"]}`, {p["microbatches"]} microbatch'
          f'{"es" if p["microbatches"] > 1 else ""}): `{p["command"][len("python "):]}` plans '
          f'{gib(p["total_bytes"])} of {gib(p["memory_bytes"])} (the bf16 base and adapters '
          f'{gib(p["param_bytes"])}, Adam\'s moments {gib(p["optimizer_bytes"])}), predicted at '
          f'{predicted(p)} a step.\n')


def dpo_8b() -> str:
  """The 8b with LoRA under DPO on 8 H100s (benchmarks/plans.py), a paragraph."""
  p = planned('dpo_8b_lora_8gpu')
  pairs = tokens(p) // 2 // 2048
  return (f'The 8b with LoRA rank 16 on 8 H100s, planned: `{p["command"]}` fits in '
          f'{gib(p["total_bytes"])} a GPU and is predicted (by the time model, not measured) at '
          f'{predicted(p)} a step of {pairs} pairs × 2048 tokens.\n')


def llama_1b_8gpu() -> str:
  """The 1b preset on 8 H100s at its own batch and at 64 sequences (benchmarks/plans.py)."""
  rows = ['| 1b, 8 × H100, fsdp=8, the preset\'s remat policy | batch | memory a GPU | '
          'step (predicted) | tokens/s a GPU | MFU |', '| --- | --- | --- | --- | --- | --- |']
  for label, name in (('the preset as it is', 'llama_1b_8gpu'),
                      ('`--config.batch_size=64`', 'llama_1b_8gpu_b64')):
    p = planned(name)
    time, batch = p['time'], tokens(p) // 4096
    rows.append(f'| {label} | {batch} × 4096 | {gib(p["total_bytes"])} | '
                f'{readable_seconds(time["seconds"])} | {time["tokens_per_s_per_device"]:,.0f} | '
                f'{time["mfu"]:.1%} |')
  return '\n'.join(rows) + '\n'


def windowed_attention() -> str:
  """The keys our kernel visits for Gemma 3's windows (benchmarks/windowed_attention.py), a
  table."""
  r = result('windowed_attention')
  rows = ['| preset | seq_len | window | head dim | tiles (block_q × block_k) | visited ÷ seen: '
          'forward, dq | dk, dv | with causal attention\'s tiles | Hopper: tiles | forward | '
          'dq | dk, dv |',
          '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  for name, p in r['presets'].items():
    c, h = p['causal_tiles'], p['hopper']
    rows.append(f'| {name} | {p["seq_len"]:,} | {p["window"]:,} | {p["head_dim"]} | '
                f'{p["block_q"]} × {p["block_k"]} | {p["forward_dq"]:.3f} | {p["dkv"]:.3f} | '
                f'{c["forward_dq"]:.3f} ({c["block_q"]} × {c["block_k"]}) | '
                f'{h["block_q"]} × {h["block_k"]} | {h["forward"]:.3f} | {h["dq"]:.3f} | '
                f'{h["dkv"]:.3f} |')
  return '\n'.join(rows) + '\n'


MUON_RESULTS = ('muon-h100-deviceless', 'muon_qwen3_8b-h100-deviceless')  # benchmarks/muon.py's


def muon_costs() -> str:
  """What each form of Muon adds to a preset's predicted step and memory against AdamW's, with
  the compiled programs' collectives (benchmarks/muon.py, each preset over 8 H100s), a table."""
  rows = ['| preset, H100s | optimizer | step (predicted) | vs AdamW | memory a GPU | vs AdamW | '
          "GEMM FLOPs more a GPU | Newton–Schulz's kernels | all-to-all | all-gather | "
          'all-reduce |', '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |']
  commands = []
  for name in MUON_RESULTS:
    r = result(name)
    commands.append(f'`{r["command"]}`')
    for form, f in r['forms'].items():
      c = f['collective_bytes']
      rows.append(f'| `{r["preset"]}`, {r["devices"]} | {form} | {readable_seconds(f["step_s"])} '
                  f'| {f["step_over_adamw"]:+.1%} | {gib(f["total_bytes"])} | '
                  f'{f["memory_over_adamw"] / 2 ** 30:+.2f} GiB | '
                  f'{f["matmul_flops_over_adamw"] / 1e12:.1f} T | '
                  + (readable_seconds(f['newton_schulz']['seconds']) if f['newton_schulz']
                     else '–') + ' | '
                  + ' | '.join(gib(c.get(op, 0)) for op in ('all-to-all', 'all-gather',
                                                            'all-reduce')) + ' |')
  return '\n'.join(rows) + f'\n\nFrom {" and ".join(commands)}.\n'


def muon_vs_adamw() -> str:
  """Muon's and AdamW's losses on the default run at each learning rate of their sweeps
  (benchmarks/optimizers.py), a table."""
  r = result('muon_vs_adamw-cpu')
  rows = ['| optimizer | peak learning rate | train loss | validation loss |',
          '| --- | --- | --- | --- |']
  for key, run in r['runs'].items():
    loss = f'{run["final_eval_loss"]:.4f}'
    rows.append(f'| {run["optimizer"]} | {run["learning_rate"]:g} | {run["train"][-1][1]:.4f} | '
                + (f'**{loss}** |' if r['best'][run['optimizer']] == key else f'{loss} |'))
  return ('\n'.join(rows) + f'\n\nNats a byte token after {r["steps"]} steps (4,096 tokens a step), '
          f'measured on a 2-core CPU, each optimizer\'s best in bold, from `{r["command"]}`.\n')


def family_plans(family: str) -> str:
  """configs/<family>.py's presets and its LoRA preset on their H100s (benchmarks/plans.py), a
  table."""
  rows = ['| command (with `--config.dry_run=True --config.plan.target=H100`) | H100s | tokens a '
          'step | remat, microbatches | memory a GPU | step (predicted) | MFU |',
          '| --- | --- | --- | --- | --- | --- | --- |']
  names = [name for name in result('plans-h100-deviceless')['plans']
           if name.startswith(family + '_')] + [f'finetune_{family}_' + {
               'qwen3': '8b_lora', 'gemma3': '4b_lora'}[family]]
  for name in names:
    p = planned(name)
    flags = p['command'].replace(' --config.dry_run=True --config.plan.target=H100', '')
    tiers = p['tiers'] and ', moments in host memory'
    rows.append(f'| `{flags}` | {p["n_devices"]} | {tokens(p):,} | {p["remat_policy"]}, '
                f'{p["microbatches"]}{tiers or ""} | {gib(p["total_bytes"])} of '
                f'{gib(p["memory_bytes"])} | {readable_seconds(p["time"]["seconds"])} | '
                f'{p["time"]["mfu"]:.1%} |')
  return '\n'.join(rows) + '\n'


def kv_cache() -> str:
  """What each `--kv_cache` kind costs the default model's predictions, on this machine's CPU
  (benchmarks/results/kv_cache-cpu.json: `python -m benchmarks.kv_cache`)."""
  kinds = result('kv_cache-cpu')['kinds']
  rows = ['| `--kv_cache` | bytes of full | loss (nats/token) | bits per byte | vs full | greedy tokens '
          "as full's | first that differs (mean) |", '| --- | --- | --- | --- | --- | --- | --- |']
  for kind, k in kinds.items():
    change = '—' if kind == 'full' else f'{k["bits_per_byte_change"]:+.3%}'
    differs = '—' if k['greedy_same'] == 1 else f'{k["greedy_tokens_before_change"]:.1f}'
    rows.append(f'| `{kind}` | {k["bytes_of_full"]:.3g} | {k["loss"]:.4f} | {k["bits_per_byte"]:.4f} '
                f'| {change} | {k["greedy_same"]:.1%} | {differs} |')
  return '\n'.join(rows) + '\n'


def kv_cache_plan() -> str:
  """One decode step of the 8b per `--kv_cache` kind, compiled for an H100 that is not there and
  read by the time model (benchmarks/results/kv_cache_plan_8b-h100-deviceless.json)."""
  kinds = result('kv_cache_plan_8b-h100-deviceless')['kinds']
  rows = ['| `--kv_cache` | cache | temporaries | step (predicted) | tokens/s a row (predicted) |',
          '| --- | --- | --- | --- | --- |']
  rows += [f'| `{kind}` | {k["cache_bytes"] / 2**30:.2f} GiB | {k["temp_bytes"] / 2**30:.2f} GiB | '
           f'{readable_seconds(k["predicted_step_s"])} | {k["predicted_tokens_per_s"]:.0f} |'
           for kind, k in kinds.items()]
  return '\n'.join(rows) + '\n'


def kv_cache_plan_gemma3() -> str:
  """One decode step of Gemma 3 4b (29 local layers, a window of 1,024, and 5 global), compiled
  for an H100 that is not there and read by the time model
  (benchmarks/results/kv_cache_plan_gemma3-4b-h100-deviceless.json), beside what its layers
  would keep if every one held every position."""
  from configs import gemma3
  from model import ModelConfig, kv_cache
  r = result('kv_cache_plan_gemma3-4b-h100-deviceless')
  cfg = ModelConfig.from_config(gemma3.get_config('4b').model)
  rows = ['| `--kv_cache` | cache (rings for local layers) | every layer every position | '
          'step (predicted) | tokens/s a row (predicted) |', '| --- | --- | --- | --- | --- |']
  for kind, k in r['kinds'].items():
    whole = kv_cache.bytes_per_token(cfg, kind) * cfg.n_layers * r['batch'] * r['slots']
    rows.append(f'| `{kind}` | {k["cache_bytes"] / 2**30:.2f} GiB | {whole / 2**30:.2f} GiB | '
                f'{readable_seconds(k["predicted_step_s"])} | '
                f'{k["predicted_tokens_per_s"]:.0f} |')
  return '\n'.join(rows) + '\n'


SPECULATIVE = [('speculative_medusa-cpu', 'Medusa, with the model (`draft_kind=medusa`)'),
               ('speculative_draft-cpu', 'Clover, with the model'),
               ('speculative_draft_alone-cpu', 'Clover, alone on the finished model (`draft_only`)')]


def speculative() -> str:
  """Tokens a forward and each head's kept share, greedy and at temperature 0.8, for the three
  runs of docs/sampling.md (benchmarks/results/speculative_*-cpu.json)."""
  rows = ['| heads, trained | greedy: tokens per forward | kept, head by head | temperature 0.8: '
          'tokens per forward | kept |', '| --- | --- | --- | --- | --- |']
  for name, label in SPECULATIVE:
    cells = []
    for r in result(name)['results']:
      cells += [f'{r["tokens_per_forward"]:.2f}', ' / '.join(f'{k:.0%}' for k in r['kept_per_head'])]
    rows.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(rows) + '\n'


def speculative_plan() -> str:
  """A plain decode step and a round of speculation of the 8b with 3 heads, compiled for an
  H100 that is not there (benchmarks/results/speculative_plan_8b_*-h100-deviceless.json), and what
  the default model's heads trained alone would make of it."""
  alone = next(r for r in result('speculative_draft_alone-cpu')['results']
               if r['temperature'] == 0)['tokens_per_forward']
  rows = ['| rows × slots | plain step | round of speculation | break-even tokens a round | '
          f'at {alone:.2f} tokens a round |', '| --- | --- | --- | --- | --- |']
  for batch, slots in ((1, 8192), (8, 8192), (64, 2048), (8, 32768)):
    r = result(f'speculative_plan_8b_b{batch}_s{slots}-h100-deviceless')
    plain, spec = r['plain_step']['predicted_s'], r['speculative_round']['predicted_s']
    rows.append(f'| {batch} × {slots:,} | {readable_seconds(plain)} | {readable_seconds(spec)} | '
                f'{r["break_even_tokens_per_round"]:.2f} | {alone * plain / spec:.1f}× the tokens/s |')
  return '\n'.join(rows) + '\n'


def grad_reduce() -> str:
  """The default model over fsdp=8 on CPU with gradients summed in fp32 and in bf16
  (benchmarks/results/precision_grad_reduce-cpu.json: every step of both curves)."""
  r = result('precision_grad_reduce-cpu')
  loss, evals = r['loss'], r['eval_loss']
  row = lambda d: ' / '.join(f'{loss[d][step - 1]:.4f}' for step in (50, 100, 200))
  late = lambda d: sum(loss[d][180:200]) / 20
  return '\n'.join([
      '| | fp32 | bf16 |', '| --- | --- | --- |',
      f'| loss at step 50 / 100 / 200 | {row("float32")} | {row("bfloat16")} |',
      f'| mean loss, steps 181–200 | {late("float32"):.4f} | {late("bfloat16"):.4f} |',
      f'| eval loss at step 200 | {evals["float32"]:.4f} | {evals["bfloat16"]:.4f} |',
      f'| relative gap over the second half, mean (largest) | | '
      f'{r["mean_relative_gap_second_half"]:.2%} ({r["max_relative_gap_second_half"]:.2%}) |']) + '\n'


def fp8() -> str:
  """The default model's 200 steps in bf16 and with fp8 projections, fp8 emulated on CPU
  (benchmarks/results/precision-cpu.json)."""
  r = result('precision-cpu')
  steps = list(r['loss_default'])
  line = lambda name, d, e: f'| {name} | ' + ' | '.join(f'{d[k]:.4f}' for k in steps) + f' | {e:.4f} |'
  return '\n'.join([
      '| step | ' + ' | '.join(steps) + ' | eval (200) |', '| --- ' * (len(steps) + 2) + '|',
      line('bf16 projections', r['loss_default'], r['eval_loss_default']),
      line('fp8 projections', r['loss_fp8'], r['eval_loss_fp8'])]) + '\n' + (
      f'\nfp8 against bf16 over the second half: {r["mean_relative_gap_second_half"]:.2%} on '
      f'average, {r["max_relative_gap_second_half"]:.2%} at most.\n')


def cudnn_packed() -> str:
  """cuDNN's attention, forward and backward of one call, on packed rows: its dense document mask,
  its packed layout at several `cudnn_segments`, and plain causal attention, on an H200
  (benchmarks/results/cudnn_packed_probe-h200.json; the packed layout as kernels/attention.py
  builds it, padding a document of its own, is the second run's)."""
  first, second = result('cudnn_packed_probe-h200')['runs']
  shapes = {'1b': "the 1b's: 8 × 4096, 32/8 heads of 64", '8b': "the 8b's: 2 × 8192, 32/8 heads of 128"}
  ms = lambda r, key: f'{r[key]["fwd_bwd_ms"]:.2f} ms'
  rows = ['| shape | dense mask | packed, 16 a row | packed, 32 | packed, 128 | no mask (plain causal) |',
          '| --- | --- | --- | --- | --- | --- |']
  for a, b in zip(first, second):
    rows.append(f'| {shapes[a["shape"]]} | {ms(a, "bias")} | {ms(b, "packed_M16_own")} | '
                f'{ms(b, "packed_M32_own")} | {ms(a, "packed_M128")} | {ms(a, "plain")} |')
  return '\n'.join(rows) + '\n'


# Published figures for Llama-class 8B training on 8 H100s, FSDP at sequence 8192, cited as their
# authors give them: (system, what, tokens/s a GPU, MFU, source).
PUBLISHED = [
    ('torchtitan', 'Llama 3.1 8B, FSDP, torch.compile', '5,762 (measured)', '33–39%',
     "torchtitan's published benchmark"),
    ('MaxText', 'Llama 2 7B, sequence 4096, FSDP', '—', '46–50% (492 TFLOP/s)',
     "MaxText's published figures"),
    ('Megatron-Core', '1.7B–462B models', '—', '41–49%', "Megatron-Core's published figures"),
]


def published() -> str:
  """The 8b preset's predicted step on 8 H100s (meshlm's row of
  benchmarks/results/peers-h100-deviceless.json) beside the published figures of other systems."""
  plan = next(p for p in result('peers-h100-deviceless')['presets'] if p['preset'] == '8b')['meshlm']
  rows = ['| system | what | tokens/s a GPU | MFU | source |', '| --- | --- | --- | --- | --- |',
          f'| meshlm | the 8b preset, fsdp=8 | {plan["tokens_per_s_per_gpu"]:,.0f} (predicted) | '
          f'{plan["mfu"]:.1%} | the time model of its compiled program |']
  rows += [f'| {system} | {what} | {tokens} | {mfu} | {source} |'
           for system, what, tokens, mfu, source in PUBLISHED]
  return '\n'.join(rows) + '\n'


TOKENIZERS = {'byte': 'byte', 'sentencepiece': 'SentencePiece 4k', 'hf': 'byte-level BPE 32k'}


def data_pipeline() -> str:
  """Packed tokens a second of the training pipeline, by tokenizer, tokenizing on the fly or
  once, and grain workers (benchmarks/results/data_pipeline-cpu.json, on its 2-core machine)."""
  r = result('data_pipeline-cpu')
  by = {(x['tokenizer'], x['tokenize'], x['workers']): x for x in r['results']}
  rows = ['| tokenizer | tokenize | 0 workers | 1 worker | 2 workers | first batch (0 workers) |',
          '| --- | --- | --- | --- | --- | --- |']
  for tokenizer, name in TOKENIZERS.items():
    for how in ('on_the_fly', 'once'):
      if (tokenizer, how, 0) not in by or (tokenizer == 'byte' and how == 'once'):
        continue  # bytes need no preparing
      label = 'on the fly' if how == 'on_the_fly' else f'once (prepared in {r["prepare_s"][tokenizer]:.1f} s)'
      rates = ' | '.join(f'{by[(tokenizer, how, w)]["tokens_per_sec"] / 1e6:.2f}M' for w in (0, 1, 2))
      rows.append(f'| {name} | {label} | {rates} | {by[(tokenizer, how, 0)]["first_batch_s"]:.2f} s |')
  return '\n'.join(rows) + '\n'


def kernel_resources() -> str:
  """Our Triton attention kernels at their default tiles, compiled deviceless for an H100, with
  segment ids (their most registers) (benchmarks/results/kernel_resources-h100-deviceless.json)."""
  names = ('flash_attention_fwd', 'flash_attention_dq', 'flash_attention_dkv')
  rows = ['| head dim | tiles, warps, stages | kernel | grid | threads | shared memory | registers | '
          'spills |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for r in result('kernel_resources-h100-deviceless')['results']:
    if not r['segments']:
      continue
    k = [r['kernels'][name] for name in names]
    grids = ' / '.join('×'.join(map(str, x['grid'])) for x in k)
    spills = sum(x['spill_stores'] + x['spill_loads'] for x in k)
    rows.append(f'| {r["head_dim"]} | {r["block_q"]} × {r["block_k"]}, {r["num_warps"]}, '
                f'{r["num_stages"]} | fwd / dq / dkv | {grids} | {k[0]["threads"]} | '
                + ' / '.join(f'{x["shared_memory"] / 1024:.0f}' for x in k) + ' KiB | '
                + ' / '.join(str(x['registers']) for x in k) + f' | {spills} |')
  return '\n'.join(rows) + '\n'


def mosaic_attention() -> str:
  """JAX's own Mosaic GPU attention beside cuDNN on an H100, TFLOP/s forward / backward
  (benchmarks/results/mosaic_attention-h100.json; its backward has no causal mask: —)."""
  rows = {(r['head_dim'], r['seq_len'], r['causal']): r
          for r in result('mosaic_attention-h100')['rows']}
  pair = lambda r, who: (f'{r[who + " fwd_tflops"]:.0f} / '
                         + (f'{r[who + " bwd_tflops"]:.0f}' if who + ' bwd_tflops' in r else '—'))
  lines = ['| head dim, keys | causal: cuDNN | causal: Mosaic GPU | full: cuDNN | full: Mosaic GPU |',
           '| --- | --- | --- | --- | --- |']
  for head_dim in (64, 128):
    for keys in (2048, 8192):
      causal, full = rows[(head_dim, keys, True)], rows[(head_dim, keys, False)]
      lines.append(f'| {head_dim}, {keys} | {pair(causal, "cudnn")} | {pair(causal, "mosaic")} | '
                   f'{pair(full, "cudnn")} | {pair(full, "mosaic")} |')
  return '\n'.join(lines) + '\n'


def checkpoint_save() -> str:
  """What a save costs the loop, on the 2-core CPU that ran it
  (benchmarks/results/checkpoint-cpu.json), a paragraph."""
  r = result('checkpoint-cpu')
  return (f'`{r["command"]}` times it ({r["n_devices"]} {r["platform"].upper()} device, a '
          f'{r["checkpoint_bytes"] / 2**30:.2f} GiB checkpoint): a step takes '
          f'{r["step_time_s"]:.1f} s and a save {r["save_s"]:.1f} s in all, of which the loop is '
          f'blocked for {r["blocked_s"]:.2f} s, {r["blocked_fraction_of_step"]:.1%} of a step '
          f'(goal: 5%). Restore takes {r["restore_s"]:.1f} s, checksums verified. The steps the '
          f'background write overlaps took {r["overlapped_step_slowdown_s"]:+.1f} s each: on a '
          'CPU the write and checksums share the cores with the step, which a GPU\'s step does '
          'not.\n')


def two_processes() -> str:
  """docs/multi-host.md's two-process job as run, process 0's log and the losses of one process
  (benchmarks/results/two_processes-cpu.json)."""
  r = result('two_processes-cpu')
  one = ', '.join(f'{x:.4f}' for x in r['one_process_losses'])
  return ('```\n' + '\n'.join(r['process0_log']) + '\n```\n'
          'Process 0\'s output (process 1 prints nothing of its own; gloo logs its connections on '
          f'both), from `{r["command"]}`. One process × 8 devices gives {one} (jax {r["jax"]} on '
          f'Python {r["python"]}), within {r["largest_relative_difference"]:.0e} of these: bf16 '
          'rounding of sums taken in another order.\n')


RENDERERS = {'plan_1b': plan_1b, 'finetune_8b': finetune_8b, 'finetune_1b': finetune_1b,
             'dpo_8b': dpo_8b, 'llama_1b_8gpu': llama_1b_8gpu,
             'kernel_resources': kernel_resources, 'mosaic_attention': mosaic_attention,
             'data_pipeline': data_pipeline, 'published': published, 'cudnn_packed': cudnn_packed, 'grad_reduce': grad_reduce, 'fp8': fp8, 'speed': speed, 'plan_8b': plan_8b, 'peers': peers, 'peers_best': peers_best, 'efficiencies': efficiencies,
             'kv_cache': kv_cache, 'kv_cache_plan': kv_cache_plan, 'speculative': speculative,
             'speculative_plan': speculative_plan,
             'checkpoint_save': checkpoint_save, 'two_processes': two_processes,
             'qwen3_plans': lambda: family_plans('qwen3'),
             'gemma3_plans': lambda: family_plans('gemma3'),
             'windowed_attention': windowed_attention, 'kv_cache_plan_gemma3': kv_cache_plan_gemma3, 'muon_costs': muon_costs,
             'muon_vs_adamw': muon_vs_adamw}


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
