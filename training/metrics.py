"""What a run reports: metrics.jsonl (one JSON object per logged step) and TensorBoard events in the
workdir, the readable stdout line with a progress bar on a terminal, peak device memory, and the
two-column tables that plans and benchmarks print."""

import json
import pathlib
import sys
import time

import jax

from training.tensorboard import EventWriter


class MetricsWriter:
  """Appends records to DIR/metrics.jsonl and to a TensorBoard event file in DIR (each number a
  scalar named by its key); only process 0 writes."""

  def __init__(self, workdir: pathlib.Path, enabled: bool = True):
    self.path = workdir / 'metrics.jsonl'
    self.enabled = enabled
    self.events = EventWriter(workdir) if enabled else None

  def drop_after(self, step: int) -> None:
    """Forget records of steps after `step` (a resumed run logs them again), atomically."""
    if not self.enabled or not self.path.exists():
      return
    kept = [line for line in self.path.read_text().splitlines()
            if line and json.loads(line)['step'] <= step]
    tmp = self.path.with_suffix('.tmp')
    tmp.write_text(''.join(line + '\n' for line in kept))
    tmp.replace(self.path)

  def write(self, record: dict) -> None:
    if self.enabled:
      with self.path.open('a') as f:
        f.write(json.dumps(record) + '\n')
      self.events.scalars(record['step'], {k: v for k, v in record.items() if k != 'step'})


def peak_memory_bytes(devices) -> int | None:
  """The most memory any of this process's `devices` has held, where the backend reports it
  (GPUs and TPUs do; the CPU does not)."""
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use') for d in devices
           if d.process_index == jax.process_index()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


class Console:
  """Process 0's stdout: log lines, and on a terminal a progress bar with an ETA beneath them,
  redrawn after every step (on a file or pipe, only the lines)."""

  def __init__(self, total_steps: int, *, enabled: bool = True, stream=None):
    self.stream = stream or sys.stdout
    self.enabled, self.total = enabled, total_steps
    self.bar = enabled and self.stream.isatty()
    self._first = None  # (step, time) when the bar started: compile time is not in the ETA
    self._shown = ''

  def log(self, line: str) -> None:
    if self.enabled:
      self.stream.write(('\r\033[K' if self._shown else '') + line + '\n' + self._shown)
      self.stream.flush()

  def step(self, done: int) -> None:
    if not self.bar:
      return
    now = time.perf_counter()
    if self._first is None or done <= self._first[0]:
      self._first = (done, now)
      eta = '…'
    else:
      per_step = (now - self._first[1]) / (done - self._first[0])
      eta = _duration(per_step * (self.total - done))
    width = 30
    filled = int(width * done / self.total)
    self._shown = (f'[{"=" * filled}{">" if filled < width else ""}{" " * (width - filled - 1)}] '
                   f'{done}/{self.total} ETA {eta}')
    self.stream.write('\r\033[K' + self._shown)
    self.stream.flush()

  def close(self) -> None:
    if self._shown:
      self.stream.write('\n')
      self.stream.flush()
      self._shown = ''


def _duration(seconds: float) -> str:
  seconds = int(seconds)
  h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
  return f'{h}h{m:02d}m' if h else f'{m}m{s:02d}s'


def format_line(record: dict, train_steps: int) -> str:
  parts = [f'step {record["step"]:>{len(str(train_steps))}}/{train_steps}']
  formats = {'loss': '.4f', 'eval_loss': '.4f', 'eval_bits_per_byte': '.3f', 'grad_norm': '.3f',
             'learning_rate': '.2e', 'tokens_per_sec': ',.0f', 'step_time_s': '.3f',
             'tflops_per_device': '.3g', 'mfu': '.1%', 'peak_memory_gib': '.2f'}
  labels = {'eval_bits_per_byte': 'bits/byte', 'learning_rate': 'lr', 'tokens_per_sec': 'tok/s',
            'step_time_s': 's/step', 'tflops_per_device': 'TFLOP/s/device', 'mfu': 'MFU',
            'peak_memory_gib': 'peak GiB'}
  for key, fmt in formats.items():
    if key in record:
      parts.append(f'{labels.get(key, key)} {record[key]:{fmt}}')
  if record.get('bad_steps'):
    parts.append(f'{record["bad_steps"]:.0f} skipped (non-finite)')
  return ' | '.join(parts)


def print_table(rows: list[tuple[str, str]]) -> None:
  width = max(len(k) for k, _ in rows)
  for key, value in rows:
    print(f'{key:<{width}}  {value}')
