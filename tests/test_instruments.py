"""What a run reports besides its loss: TFLOP/s and MFU (same formula as the benchmarks),
TensorBoard events (tensorboardX) readable by TensorBoard itself, a progress bar only on a terminal, a profiler
trace of the steps asked for, and peak device memory where the backend reports it."""

import gzip
import io
import json
import types

import pytest
from tensorboard.backend.event_processing import event_accumulator

from model import ModelConfig
from planning import flops
from reporting import metrics
from tests.conftest import tiny_config
from training import loop


def test_mfu_matches_a_hand_count():
  cfg = ModelConfig.from_config(tiny_config().model)  # D 64, 2 layers, 4/2 heads of 16, F 128, V 384
  per_layer = 64 * 16 * (4 + 4 + 2 + 2) + 3 * 64 * 128  # q, o, k, v; gate, up, down = 36,864
  dense = 6 * (2 * per_layer + 64 * 384)  # + the output head = 589,824
  attention = 12 * 2 * 4 * 16 * 32 / 2  # causal at seq 32 = 24,576
  assert dense + attention == 614_400
  speed = flops.throughput(cfg, 32, tokens_per_sec=2e6, n_devices=8,
                           device_kind='NVIDIA H100 80GB HBM3')
  assert speed['tflops_per_device'] == pytest.approx(614_400 * 2e6 / 8 / 1e12)
  assert speed['mfu'] == pytest.approx(0.1536 / 989)
  assert flops.throughput(cfg, 32, 2e6, 8, 'cpu') == {'tflops_per_device': pytest.approx(0.1536)}


@pytest.mark.integration
def test_a_run_reports_tflops_to_stdout_metrics_and_tensorboard_and_traces_steps(tmp_path, capsys):
  c = tiny_config(fsdp=8)
  c.workdir, c.train_steps, c.log_every, c.eval_every = str(tmp_path), 4, 2, 4
  c.profile_steps, c.profile_start = 1, 3
  records = loop.run(c)
  out = capsys.readouterr().out
  assert 'TFLOP/s/device' in out and 'MFU' not in out  # no known peak for a CPU
  assert '\r' not in out and 'ETA' not in out  # not a terminal: plain lines
  logged = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert logged == records
  train = [r for r in logged if 'loss' in r]
  for r in train:
    expected = flops.throughput(ModelConfig.from_config(c.model), c.seq_len,
                                r['tokens_per_sec'], 8, 'cpu')['tflops_per_device']
    assert r['tflops_per_device'] == pytest.approx(expected) and 'mfu' not in r
    assert 'peak_memory_gib' not in r  # the CPU backend reports no memory statistics

  # TensorBoard reads every number of metrics.jsonl (float32) from the event file we wrote.
  events = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={'scalars': 0})
  events.Reload()
  for key in ('loss', 'grad_norm', 'tflops_per_device', 'eval_loss'):
    wanted = [(r['step'], r[key]) for r in logged if key in r]
    got = [(e.step, e.value) for e in events.Scalars(key)]
    assert [s for s, _ in got] == [s for s, _ in wanted]
    assert [v for _, v in got] == pytest.approx([v for _, v in wanted], rel=1e-6)

  # The trace holds the compiled train step, for TensorBoard's profiler and Perfetto.
  traces = list((tmp_path / 'profile').rglob('perfetto_trace.json.gz'))
  assert len(traces) == 1 and list((tmp_path / 'profile').rglob('*.xplane.pb'))
  trace = json.loads(gzip.decompress(traces[0].read_bytes()))
  names = {e.get('name', '') for e in trace['traceEvents']}
  assert any('train_step' in n for n in names)


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_progress_bar_only_on_a_terminal():
  terminal, pipe = _Terminal(), io.StringIO()
  for stream in (terminal, pipe):
    console = metrics.Console(10, stream=stream)
    for done in range(1, 11):
      console.step(done)
      if done == 5:
        console.log('step 5/10 | loss 1.0')
    console.close()
  assert '\r' in terminal.getvalue() and 'ETA' in terminal.getvalue()
  assert '10/10' in terminal.getvalue()
  assert 'step 5/10 | loss 1.0\n' in terminal.getvalue()  # log lines stay whole
  assert pipe.getvalue() == 'step 5/10 | loss 1.0\n'


def test_peak_memory_is_the_largest_reported():
  device = lambda peak: types.SimpleNamespace(process_index=0,
                                              memory_stats=lambda: {'peak_bytes_in_use': peak})
  assert metrics.peak_memory_bytes([device(5), device(9)]) == 9
  assert metrics.peak_memory_bytes([types.SimpleNamespace(process_index=0,
                                                          memory_stats=lambda: None)]) is None
