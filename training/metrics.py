"""metrics.jsonl (one JSON object per logged step) and the readable stdout line."""

import json
import os
import pathlib


def prepare_workdir(workdir: str) -> pathlib.Path:
  """Create the workdir and prove it is writable, before anything expensive happens."""
  path = pathlib.Path(workdir).expanduser()
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f'.write-test-{os.getpid()}'
    probe.write_text('ok')
    probe.unlink()
  except OSError as e:
    raise ValueError(f'config.workdir={workdir!r} is not a writable directory ({e}); '
                     'pass --config.workdir=DIR with a directory you can write') from None
  return path


class MetricsWriter:
  """Appends records to DIR/metrics.jsonl; only process 0 writes."""

  def __init__(self, workdir: pathlib.Path, enabled: bool = True):
    self.path = workdir / 'metrics.jsonl'
    self.enabled = enabled

  def write(self, record: dict) -> None:
    if self.enabled:
      with self.path.open('a') as f:
        f.write(json.dumps(record) + '\n')


def format_line(record: dict, train_steps: int) -> str:
  parts = [f'step {record["step"]:>{len(str(train_steps))}}/{train_steps}']
  formats = {'loss': '.4f', 'eval_loss': '.4f', 'grad_norm': '.3f', 'learning_rate': '.2e',
             'tokens_per_sec': ',.0f', 'step_time_s': '.3f'}
  labels = {'learning_rate': 'lr', 'tokens_per_sec': 'tok/s', 'step_time_s': 's/step'}
  for key, fmt in formats.items():
    if key in record:
      parts.append(f'{labels.get(key, key)} {record[key]:{fmt}}')
  return ' | '.join(parts)
