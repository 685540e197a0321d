"""metrics.jsonl (one JSON object per logged step), the readable stdout line, and the two-column
tables that plans and benchmarks print."""

import json
import pathlib

from data.corpus import writable_dir


def prepare_workdir(workdir: str) -> pathlib.Path:
  """Create the workdir and prove it is writable, before anything expensive happens."""
  return writable_dir(workdir, 'config.workdir')


class MetricsWriter:
  """Appends records to DIR/metrics.jsonl; only process 0 writes."""

  def __init__(self, workdir: pathlib.Path, enabled: bool = True):
    self.path = workdir / 'metrics.jsonl'
    self.enabled = enabled

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


def format_line(record: dict, train_steps: int) -> str:
  parts = [f'step {record["step"]:>{len(str(train_steps))}}/{train_steps}']
  formats = {'loss': '.4f', 'eval_loss': '.4f', 'eval_bits_per_byte': '.3f', 'grad_norm': '.3f', 'learning_rate': '.2e',
             'tokens_per_sec': ',.0f', 'step_time_s': '.3f'}
  labels = {'eval_bits_per_byte': 'bits/byte', 'learning_rate': 'lr', 'tokens_per_sec': 'tok/s', 'step_time_s': 's/step'}
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
