"""The step, precision, checkpoint, MoE, NVMe and calibrate benchmarks, and the fault probe, run end to end (on
the tiny base config, or tiny shapes) and end with one JSON line of figures that add up."""

import gzip
import json
import pathlib
import statistics
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def figures(script, *flags, config=('--config=configs/base.py',)):
  result = subprocess.run([sys.executable, '-m', f'benchmarks.{script}', *config, *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_train_step_benchmark():
  f = figures('train_step', '--steps=2', '--warmup=1')
  assert f['step_time_s_min'] <= f['step_time_s'] <= f['step_time_s_max']
  assert f['tokens_per_sec'] == f['batch_size'] * f['seq_len'] / f['step_time_s']
  assert f['mfu'] is None  # no peak is known for a CPU
  assert (f['compute_dtype'], f['matmul_precision']) == ('bfloat16', 'default')


@pytest.mark.integration
def test_precision_benchmark():
  f = figures('precision', '--config.train_steps=4', '--config.eval_every=4',
              '--config.eval_batches=1')
  assert f['steps'] == 4 and sorted(f['loss_fp8']) == sorted(f['loss_default']) == ['1', '2', '4']
  last = abs(f['loss_fp8']['4'] - f['loss_default']['4']) / f['loss_default']['4']
  assert f['max_relative_gap_second_half'] >= last > 0  # fp8 is not the same computation
  assert f['eval_loss_fp8'] > 0 and f['eval_loss_default'] > 0


@pytest.mark.integration
def test_checkpoint_benchmark():
  f = figures('checkpoint', '--steps=1', '--saves=1')
  assert 0 < f['blocked_s'] < f['save_s'] and 0 < f['restore_s']
  assert f['blocked_fraction_of_step'] == f['blocked_s'] / f['step_time_s']
  assert f['checkpoint_bytes'] > 3 * 4 * f['params']  # parameters and two Adam moments in fp32


@pytest.mark.integration
def test_nvme_benchmark_moves_every_way_through_the_disk(tmp_path):
  """Each way writes, syncs, drops the cache and reads back what it wrote (a way that returned
  other bytes fails the run); figures against dd's; too little room is one line, nothing made."""
  f = figures('nvme', f'--dir={tmp_path}', '--gib=0.008', '--block_mib=1', '--repeats=1', config=())
  assert f['bytes'] == 8 * 2**20 and set(f['ways']) == {'dd', 'direct', 'buffered', 'tensorstore',
                                                       'tier', 'checkpoint'}
  for w in f['ways'].values():
    assert w['read_gb_per_s'] == f['bytes'] / w['read_s'] / 1e9 and w['write_s'] > 0
    assert w['read_of_dd'] == w['read_gb_per_s'] / f['ways']['dd']['read_gb_per_s']
  assert list(tmp_path.iterdir()) == []  # its folder removed
  result = subprocess.run([sys.executable, '-m', 'benchmarks.nvme', f'--dir={tmp_path}',
                           '--gib=1000000'], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode != 0 and 'lower --gib' in result.stderr
  assert 'Traceback' not in result.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_moe_benchmark_compiles_each_implementation_for_h100():
  """Deviceless at tiny shapes: ours as its two Triton kernels without spills, and every
  implementation's temporaries; ragged_dot's, dense on GPUs, larger than ours."""
  f = figures('moe', '--shape=512,64,64,4', config=())
  assert f['deviceless'] and f['compiled_for'] == 'NVIDIA H100 80GB HBM3'
  ours = f['results']['pallas']
  assert set(ours['kernels']) == {'grouped_matmul', 'grouped_matmul_dw'}
  assert not any(k['spill_stores'] or k['spill_loads'] for k in ours['kernels'].values())
  assert f['results']['ragged_dot']['temp_bytes'] > ours['temp_bytes']


@pytest.mark.integration
def test_the_peers_search_compiles_each_candidate_and_judges_what_fits(h100):
  """Deviceless, meshlm's side on the tiny preset: every candidate of a space compiled and read
  by the time model; what fits a memory is what needs no more, the best the fastest of those,
  and the curve holds each candidate faster than all that need less."""
  from benchmarks import peers
  space = [{'model.scan_layers': scan, 'model.remat_policy': policy}
           for scan in (False, True) for policy in ('full', 'none')]
  rows = peers.search('tiny', peers.PRESETS['tiny'](), 'meshlm', space, memory_bytes=2**40,
                      log=lambda *_: None)
  assert [r['settings'] for r in rows] == space and all(r['fits'] for r in rows)
  by = {(r['settings']['model.scan_layers'], r['settings']['model.remat_policy']): r for r in rows}
  for scan in (False, True):  # keeping every activation needs more, and recomputes none
    assert by[scan, 'none']['total_bytes'] > by[scan, 'full']['total_bytes']
    assert by[scan, 'none']['gemm_flops'] < by[scan, 'full']['gemm_flops']
  totals = sorted({r['total_bytes'] for r in rows})
  limit = totals[len(totals) // 2] - 1
  peers.judge(rows, limit)
  fitting = [r for r in rows if r['fits']]
  assert 0 < len(fitting) < len(rows)
  assert all(r['fits'] == (r['total_bytes'] <= limit) for r in rows)
  assert peers.best(rows) is min(fitting, key=lambda r: r['step_s'])
  curve = peers.front(rows)
  assert [r['total_bytes'] for r in curve] == sorted(r['total_bytes'] for r in curve)
  assert all(a['step_s'] > b['step_s'] for a, b in zip(curve, curve[1:]))
  assert all(any(c['total_bytes'] <= r['total_bytes'] and c['step_s'] <= r['step_s']
                 for c in curve) for r in rows)
  assert peers.label(space[1]) == 'unrolled, none' and peers.best(peers.judge(rows, 0)) is None


@pytest.mark.integration
def test_the_cache_and_speculation_plans_compile_decode_steps_for_h100():
  """Deviceless, the 125m preset: each kind's cache is what its compiled step takes as arguments
  beside the weights, and the time model predicts each step; a round of speculation, its draft
  heads' bytes as stated, is predicted slower than a one-token step."""
  from benchmarks import kv_cache as benchmark
  from configs import llama
  from model import ModelConfig, kv_cache
  # three kinds of six (the rest's bytes and losses: test_generate's run of the benchmark)
  f = benchmark.plan('125m', batch=2, slots=256, target='H100', kinds=('full', 'int8', 'int4'))
  assert f['deviceless'] and f['compiled_for'] == 'NVIDIA H100 80GB HBM3'
  c = llama.get_config('125m')
  c.model.param_dtype = 'bfloat16'
  cfg = ModelConfig.from_config(c.model)
  for kind, r in f['kinds'].items():
    assert r['cache_bytes'] == (kv_cache.bytes_per_token(cfg, kind) * cfg.n_layers * 2 * 256
                                + kv_cache.fixed_bytes(cfg, kind)), kind
    assert r['predicted_step_s'] > 0
  assert f['kinds']['int4']['cache_bytes'] < f['kinds']['int8']['cache_bytes'] < \
      f['kinds']['full']['cache_bytes']
  # A round of speculation (heads, a forward of K + 1 tokens, acceptance) beside a plain step.
  from benchmarks import speculative
  f = speculative.plan('125m', heads=2, batch=2, slots=256, target='H100')
  assert f['deviceless'] and f['draft_bytes'] == 2 * 2 * 3 * (cfg.d_model ** 2 + cfg.d_model)
  assert 0 < f['plain_step']['predicted_s'] < f['speculative_round']['predicted_s']


@pytest.mark.integration
def test_calibrate_measures_and_predicts_every_part_on_tiny_shapes(tmp_path):
  """Its plumbing, on the CPU (ratios against the time model's nominal device mean nothing here):
  each part's rows measured and predicted, its file, and the constants its rows imply."""
  from planning import timing
  f = figures('calibrate', '--gemms=64x64x64,128x256x64', '--copy_mib=1', '--host_mib=1', '--chain=5',
              '--head_dims=64', '--seq_lens=128', '--tokens=256', '--impls=pallas,xla',
              '--step_configs=configs/base.py', '--step_attention=xla', '--iters=2',
              '--step_iters=1', f'--out_dir={tmp_path}', config=())
  assert list(f['parts']) == ['steps_base', 'attention', 'gemm', 'copy', 'host']  # a step first
  for part, figures_of in f['parts'].items():
    written = json.loads((tmp_path / f'calibrate_{part}-cpu.json').read_text())
    assert written == figures_of and written['jax'] and 'benchmarks.calibrate' in written['command']
    with gzip.open(tmp_path / f'calibrate_{part}-cpu.programs.json.gz') as bank_file:
      bank = json.load(bank_file)['programs']
    for row in written['rows']:
      assert row['measured_s'] > 0 and row['predicted_s'] > 0
      assert row['ratio'] == row['measured_s'] / row['predicted_s']
      # its program as compiled, and the kernels its profiled calls ran: the jitted module's own
      names = [row['what']] + ([f'{row["what"]} fwd_bwd'] if 'fwd_bwd' in row else [])
      for name in names:
        assert bank[name]['hlo'].startswith('HloModule')
        profile = bank[name]['profile']
        assert profile['calls'] == 3 and profile['events'][0]['us'] > 0
        hlo_ops = {e['hlo_op'] for e in profile['events']}
        assert hlo_ops and all(f'{op} = ' in bank[name]['hlo'] for op in hlo_ops), name
    assert len(bank) == len(written['rows']) + sum('fwd_bwd' in r for r in written['rows'])
  parts = f['parts']
  assert [r['precision'] for r in parts['gemm']['rows']] == ['bf16', 'fp8'] * 2
  assert set(parts['gemm']['refit']) == {'GEMM_EFFICIENCY', 'FP8_GEMM_EFFICIENCY'}
  assert set(parts['copy']['refit']) == {'HBM_EFFICIENCY', 'KERNEL_LAUNCH_S'}
  host = parts['host']['rows']
  assert [r['way'] for r in host] == ['to host', 'from host', 'both ways']
  assert parts['host']['refit'] == {'host_bandwidth': min(r['gb_per_s'] for r in host[:2]) * 1e9,
                                    'host_duplex_bandwidth': host[2]['gb_per_s'] * 1e9}
  assert [r['impl'] for r in parts['attention']['rows']] == ['pallas', 'xla']  # no cuDNN on CPU
  steps = parts['steps_base']['rows']
  assert [r['matmul_precision'] for r in steps] == ['default', 'fp8']
  assert all(set(r['predicted_breakdown']) == set(timing.PARTS) for r in steps)
  for m in (r['memory'] for r in steps):  # the memory the step's compile planned
    assert m['total'] == m['argument'] + m['output'] + m['temp'] - m['alias'] > 0

  # memory_truth sets a banked step's memory beside a deviceless compile of the same step; a
  # row banked without memory (as before calibrate kept it) is skipped. This bank is the CPU's,
  # named an H100's: the plumbing, not the ratio, is what a CPU can check.
  banked = json.loads((tmp_path / 'calibrate_steps_base-cpu.json').read_text())
  del banked['rows'][1]['memory']
  as_h100 = tmp_path / 'calibrate_steps_base-h100.json'
  as_h100.write_text(json.dumps(banked))
  truth = figures('memory_truth', f'--files={as_h100}', config=())
  assert truth['skipped'] == 1 and [r['what'] for r in truth['compared']] == [steps[0]['what']]
  row = truth['compared'][0]
  here = row['deviceless']
  assert row['gpu'] == steps[0]['memory'] and row['ratio'] == here['total'] / row['gpu']['total']
  assert here['total'] == here['argument'] + here['output'] + here['temp'] - here['alias'] > 0


def test_calibrate_stops_a_part_past_its_budget(tmp_path):
  f = figures('calibrate', '--parts=copy', '--copy_mib=1,2', '--part_budget_s=0', '--iters=1',
              f'--out_dir={tmp_path}', config=())
  rows = f['parts']['copy']['rows']
  assert len(rows) == 2 and rows[0]['what'] == 'pass over 1 MiB' and 'skipped' in rows[1]


@pytest.mark.integration
def test_calibrate_check_re_predicts_the_bank_within_the_goal(capsys):
  from benchmarks import calibrate
  calibrate.check(str(REPO / 'benchmarks' / 'results'))
  f = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert f['programs'] >= 64 and f['missing_goal'] == [] and all(f['ratios'].values())


def copy_rows(*mib):
  """Rows of calibrate's copy part as a run writes them, and their programs."""
  rows = [{'what': f'pass over {m} MiB', 'bytes': 2 * m * 2**20, 'measured_s': m * 1e-3,
           'predicted_s': m * 1e-3, 'ratio': 1.0, 'launches': 1, 'tb_per_s': 2 * 2**20 / 1e9}
          for m in mib]
  rows.append({'what': 'chain of 2 small matmuls', 'kernels': 2, 'measured_s': mib[0] * 1e-5,
               'predicted_s': 1e-5, 'ratio': mib[0], 'launches': 2, 'per_kernel_s': mib[0] * 5e-6})
  return rows, {r['what']: {'hlo': f'HloModule {r["what"]}', 'profile': {'calls': 3, 'events': []}}
                for r in rows}


def test_calibrate_merges_other_runs_into_the_bank(tmp_path):
  """Two GPU commands' parts, merged: a row of the same `what` replaced, the others kept, the
  refit made again from them all, a run's "skipped" row (where its budget ended) left out, a kept
  row whose name begins with a replaced one's kept with its program; a bank of another device is
  refused."""
  from benchmarks import bank, calibrate
  for run, mib in (('a', (1, 2)), ('b', (2, 3))):
    rows, programs = copy_rows(*mib)
    if run == 'a':  # named as a variant of the row b replaces, as the offloaded steps are
      rows.insert(2, {**rows[1], 'what': 'pass over 2 MiB again'})
      programs['pass over 2 MiB again'] = programs['pass over 2 MiB']
      programs['pass over 2 MiB fwd_bwd'] = programs['pass over 2 MiB']  # b's row replaces it
    rows.append({'what': 'the rest of this part', 'skipped': 'past --part_budget_s=1'})
    bank.write_part(str(tmp_path / run), 'copy', 'cpu', {
        'benchmark': 'calibrate_copy', 'device': 'cpu', 'platform': 'cpu', 'jax': '0.11.2',
        'model_for': 'nominal device', 'rows': rows, 'refit': {}, 'seconds': 1.0,
        'command': f'python -m benchmarks.calibrate --run={run}'}, programs)
  calibrate.merge([str(tmp_path / 'a'), str(tmp_path / 'b')], str(tmp_path))
  merged = json.loads((tmp_path / 'calibrate_copy-cpu.json').read_text())
  b = json.loads((tmp_path / 'b' / 'calibrate_copy-cpu.json').read_text())
  whats = [r['what'] for r in merged['rows']]
  assert whats == ['pass over 1 MiB', 'pass over 2 MiB again', 'pass over 2 MiB', 'pass over 3 MiB',
                   'chain of 2 small matmuls']
  assert merged['rows'][2:] == b['rows'][:-1] and len(merged['command']) == 2
  assert merged['refit']['KERNEL_LAUNCH_S'] == 2 * 5e-6  # b's chain replaced a's
  assert merged['refit']['HBM_EFFICIENCY'] == pytest.approx(2 * 2**20 / 1e9)  # of nominal 1 TB/s
  with gzip.open(tmp_path / 'calibrate_copy-cpu.programs.json.gz') as f:
    assert sorted(json.load(f)['programs']) == sorted(whats)
  other = json.loads((tmp_path / 'b' / 'calibrate_copy-cpu.json').read_text())
  (tmp_path / 'b' / 'calibrate_copy-cpu.json').write_text(json.dumps({**other, 'device': 'H200'}))
  with pytest.raises(ValueError, match='ran on H200'):
    calibrate.merge([str(tmp_path / 'b')], str(tmp_path))


def test_the_fault_probe_runs_its_cases_and_counts_them():
  """Cheap cases only (no training): the probe script stays runnable, and judges."""
  result = subprocess.run([sys.executable, 'scripts/fault_probe.py', '--only=config: missing'], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  f = json.loads(result.stdout.strip().splitlines()[-1])
  assert result.returncode == 0 and f == {**f, 'cases': 2, 'GOOD': 2, 'UGLY': 0, 'BAD': 0}, (
      result.stdout[-3000:])


def test_every_benchmark_runs_as_a_script_too():
  """`python benchmarks/X.py` puts benchmarks/ first on the path: a benchmark named as one of
  meshlm's packages (benchmarks/data.py once) would hide it from every import of it."""
  packages = set(tomllib.loads((REPO / 'pyproject.toml').read_text())['tool']['setuptools'][
      'packages']) | {p.stem for p in REPO.glob('*.py')}
  assert not {p.stem for p in (REPO / 'benchmarks').glob('*.py')} & packages
  result = subprocess.run([sys.executable, 'benchmarks/calibrate.py', '--help'], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
  assert '--parts' in result.stdout and not result.stderr, result.stderr[-3000:]  # absl: exit 1


@pytest.mark.integration
def test_the_side_by_side_rehearsal_times_each_candidate_and_banks_what_ran(tmp_path):
  """--dry on this CPU: meshlm's tiny preset timed in a child process, its program banked and
  predicted; MaxText's candidates timed where this Python imports MaxText, else each row says
  why not; the wheels a lent GPU would be given sized against what travels."""
  wheels = tmp_path / 'whl'
  wheels.mkdir()
  (wheels / 'maxtext-site.tar.xz').write_bytes(b'x' * 1000)
  f = figures('side_by_side', '--dry', '--timed_steps=2', '--warmup_steps=1',
              '--profiled_steps=1', f'--bank_dir={tmp_path}', f'--wheels={wheels}', config=())
  rows = {r['what']: r for r in f['rows']}
  ours = rows['tiny meshlm scanned, none (as it ships)']
  assert len(ours['times_s']) == 2 and ours['measured_s'] == statistics.median(ours['times_s'])
  assert ours['tokens_per_s_per_device'] == pytest.approx(16 * 128 / ours['measured_s'])
  assert ours['ratio'] == pytest.approx(ours['measured_s'] / ours['predicted_s'])
  assert ours['memory']['total'] > 0 and ours['loss'] > 0 and ours['jax'] == f['jax']
  maxtext = [r for r in f['rows'] if r['system'] == 'MaxText']
  assert [r['settings'] for r in maxtext] == [{}, {'scan_layers': 'false'}]
  for r in maxtext:
    assert 'measured_s' in r or "No module named 'maxtext'" in r['error'], r
    assert 'hardware=cpu' in r['argv'] and 'attention=dot_product' in r['argv']
  banked = json.loads((tmp_path / 'calibrate_steps_side_by_side-cpu.json').read_text())
  assert [r['what'] for r in banked['rows']] == [r['what'] for r in f['rows']]
  with gzip.open(tmp_path / 'calibrate_steps_side_by_side-cpu.programs.json.gz') as p:
    programs = json.load(p)['programs']
  assert sorted(programs) == sorted(r['what'] for r in f['rows'] if 'measured_s' in r)
  assert 'ENTRY' in programs[ours['what']]['hlo'] and 'calls' in programs[ours['what']]['profile']
  w = f['wheels']
  assert w['maxtext_site'] and w['carried_bytes'] == 1000 and w['fits']
  assert 1 << 20 < w['tree_bytes'] < 64 << 20
  # Banked as a GPU's, its steps are train steps `calibrate --check` re-predicts
  from benchmarks import bank
  for suffix in ('.json', '.programs.json.gz'):
    (tmp_path / f'calibrate_steps_side_by_side-cpu{suffix}').rename(
        tmp_path / f'calibrate_steps_side_by_side-h100{suffix}')
  checked = bank.check(str(tmp_path))
  assert sorted(c.what for c in checked) == sorted(programs)
  assert all(c.kind == 'step' and c.measured_s == rows[c.what]['measured_s'] for c in checked)


def test_side_by_side_compares_the_fastest_of_each_and_meshlms_at_no_more_memory():
  from benchmarks import side_by_side
  def row(system, s, gib):
    return {'what': f'{system} {s}', 'system': system, 'measured_s': s,
            'tokens_per_s_per_device': 100 / s, 'memory': {'total': gib}}
  rows = [row('meshlm', 1.0, 50), row('meshlm', 1.1, 40), row('MaxText', 1.2, 45),
          row('MaxText', 1.3, 30), {'what': 'MaxText oom', 'system': 'MaxText', 'error': 'x'}]
  c = side_by_side.compared(rows)
  assert (c['meshlm_fastest'], c['MaxText_fastest']) == ('meshlm 1.0', 'MaxText 1.2')
  assert c['tokens_per_s_ratio'] == pytest.approx(1.2)
  assert c['at_no_more_memory'] == {'meshlm': 'meshlm 1.1',
                                    'tokens_per_s_ratio': pytest.approx(1.2 / 1.1)}
  assert side_by_side.compared(rows[2:])['MaxText_fastest'] == 'MaxText 1.2'
  assert 'tokens_per_s_ratio' not in side_by_side.compared(rows[2:])
