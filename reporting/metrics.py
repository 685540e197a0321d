"""What a run reports: metrics.jsonl (one JSON object per logged step) and TensorBoard events in the
workdir (tensorboardX), the readable stdout line with a tqdm progress bar on a terminal, peak device
memory, and the two-column tables that plans and benchmarks print."""

import json
import logging
import pathlib
import sys

import jax
import tqdm

# tensorboardX warns of every non-finite value it writes: the step's own line says so already.
logging.getLogger('tensorboardX.x2num').setLevel(logging.ERROR)


class MetricsWriter:
  """Appends records to DIR/metrics.jsonl and, each number a scalar named by its key, to
  TensorBoard event files in DIR; only process 0 writes.

  A resumed run logs again the steps after its checkpoint (`drop_after`): metrics.jsonl forgets
  them, and this run's event file opens with TensorBoard's purge marker (tensorboardX's
  `purge_step`), so TensorBoard hides what earlier files hold from that step on."""

  def __init__(self, workdir: pathlib.Path, enabled: bool = True):
    self.workdir, self.path = workdir, workdir / 'metrics.jsonl'
    self.enabled = enabled
    self.events = None

  def _open_events(self, purge_step: int | None = None) -> None:
    from tensorboardX import SummaryWriter  # imported here: the GPU image lacks it
    self.events = SummaryWriter(logdir=str(self.workdir), purge_step=purge_step)

  def drop_after(self, step: int) -> None:
    """Forget records of steps after `step` (a resumed run logs them again), atomically."""
    if not self.enabled:
      return
    if self.events is None:
      self._open_events(purge_step=step + 1)
    if not self.path.exists():
      return
    kept = [line for line in self.path.read_text().splitlines()
            if line and json.loads(line)['step'] <= step]
    tmp = self.path.with_suffix('.tmp')
    tmp.write_text(''.join(line + '\n' for line in kept))
    tmp.replace(self.path)

  def keys_at(self, step: int) -> set[str]:
    """The keys metrics.jsonl's records of `step` hold."""
    if not self.path.exists():
      return set()
    return {key for line in self.path.read_text().splitlines() if line
            for record in [json.loads(line)] if record['step'] == step for key in record}

  def write(self, record: dict) -> None:
    if self.enabled:
      with self.path.open('a') as f:
        f.write(json.dumps(record) + '\n')
      if self.events is None:
        self._open_events()
      for key, value in record.items():
        if key != 'step':
          self.events.add_scalar(key, value, record['step'])
      self.events.flush()  # what is logged is on disk, as metrics.jsonl is

  def close(self) -> None:
    if self.events:
      self.events.close()


def peak_memory_bytes(devices) -> int | None:
  """The most memory any of this process's `devices` has held, where the backend reports it
  (GPUs and TPUs do; the CPU does not)."""
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use') for d in devices
           if d.process_index == jax.process_index()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


class Console:
  """Process 0's stdout: log lines, and on a terminal a tqdm progress bar with an ETA beneath them
  (on a file or pipe, only the lines). The bar starts at the first step, so compiling is not in
  its ETA."""

  BAR = '{n_fmt}/{total_fmt} [{bar:30}] {elapsed}, ETA {remaining}'

  def __init__(self, total_steps: int, *, enabled: bool = True, stream=None):
    self.stream = stream or sys.stdout
    self.enabled, self.total = enabled, total_steps
    self.on_terminal = enabled and self.stream.isatty()
    self.bar = None

  def log(self, line: str) -> None:
    if self.bar:
      self.bar.write(line, file=self.stream)  # above the bar, which is redrawn beneath
    elif self.enabled:
      print(line, file=self.stream, flush=True)

  def step(self, done: int) -> None:
    if not self.on_terminal:
      return
    if self.bar is None:
      self.bar = tqdm.tqdm(total=self.total, initial=done, file=self.stream,
                           bar_format=self.BAR, dynamic_ncols=True)
    self.bar.update(done - self.bar.n)

  def close(self) -> None:
    if self.bar:
      self.bar.close()
      self.bar = None


def format_line(record: dict, train_steps: int) -> str:
  parts = [f'step {record["step"]:>{len(str(train_steps))}}/{train_steps}']
  formats = {'loss': '.4f', 'reward_accuracy': '.0%', 'reward_margin': '.3f', 'eval_loss': '.4f',
             'eval_reward_accuracy': '.0%', 'eval_bits_per_byte': '.3f', 'grad_norm': '.3f',
             'learning_rate': '.2e', 'tokens_per_sec': ',.0f', 'step_time_s': '.3f',
             'tflops_per_device': '.3g', 'mfu': '.1%', 'peak_memory_gib': '.2f'}
  labels = {'eval_bits_per_byte': 'bits/byte', 'reward_accuracy': 'reward acc',
            'reward_margin': 'margin', 'eval_reward_accuracy': 'eval reward acc', 'learning_rate': 'lr', 'tokens_per_sec': 'tok/s',
            'step_time_s': 's/step', 'tflops_per_device': 'TFLOP/s/device', 'mfu': 'MFU',
            'peak_memory_gib': 'peak GiB'}
  for key, fmt in formats.items():
    if key in record:
      parts.append(f'{labels.get(key, key)} {record[key]:{fmt}}')
  heads = sorted((k for k in record if k.startswith('draft') and k.endswith('_accuracy')),
                 key=lambda k: int(k[len('draft'):-len('_accuracy')]))
  if heads:  # draft1_accuracy, … (model/draft.py)
    parts.append('draft top-1 ' + ' / '.join(f'{record[k]:.0%}' for k in heads))
  for key, what in (('eval_pairs', 'pair'), ('eval_tokens', 'token')):
    if record.get(key, None) == 0:  # its means are absent: say so, not a blank line
      parts.append(f'eval: no validation {what} to score in its rows')
  if record.get('bad_steps'):
    parts.append(f'{record["bad_steps"]:.0f} skipped (non-finite)')
  if 'lm_eval_time_s' in record:  # lm-eval's tasks (evaluation/during.py): <task>/<metric>
    parts += [f'{key} {value:.4g}' for key, value in record.items() if '/' in key]
    parts.append(f'scored in {record["lm_eval_time_s"]:.1f}s')
  return ' | '.join(parts)


def print_table(rows: list[tuple[str, str]]) -> None:
  width = max(len(k) for k, _ in rows)
  for key, value in rows:
    print(f'{key:<{width}}  {value}')
