"""The loss curves fresh runs are held to: every step's training loss (and each evaluation) of
configs/base.py's 100 steps and of the fine-tuning walkthrough's tiny run (configs/finetune.py),
run on this machine's CPU as a user runs them: one device, the configs' own settings.

  python scripts/loss_curves.py                # both, into tests/data/curves/
  python scripts/loss_curves.py --only=base

The walkthrough's inputs are made as its docstring makes them, in a temporary directory: the
standard library's docstrings as chat records, and the tiny Llama of tests/data with Llama 3's
chat template. Each file holds the command, jax's version, the devices and the curve;
tests/test_training.py and tests/test_chat.py hold fresh runs to them, and the configs'
"Should reach" figures are read from them.
"""

import argparse
import json
import os
import pathlib
import shutil
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / 'tests' / 'data' / 'curves'
sys.path.insert(0, str(REPO))


def base_config(workdir: pathlib.Path):
  import configs
  config = configs.load('base.py')
  config.workdir = str(workdir)
  config.log_every, config.checkpoint_every = 1, 0
  return config


def finetune_inputs(directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """(the chat records, the tiny Llama with a chat template), as the walkthrough makes them."""
  from data import stdlib_chat
  records = directory / 'stdlib-chat.jsonl'
  stdlib_chat.write(records, stdlib_chat._MAX.default)  # its --max_records, as the docstring runs it
  llama = directory / 'tiny-llama'
  shutil.copytree(REPO / 'tests' / 'data' / 'hf-llama-untied', llama)
  for file in (REPO / 'tests' / 'data' / 'hf-chat' / 'llama3').iterdir():
    shutil.copyfile(file, llama / file.name)
  return records, llama


def finetune_config(workdir: pathlib.Path, records: pathlib.Path, llama: pathlib.Path):
  import configs
  config = configs.load('finetune.py')
  config.workdir, config.init_from = str(workdir), f'hf:{llama}'
  config.data.paths = str(records)
  config.log_every, config.checkpoint_every = 1, 0
  return config


def curve(records: list[dict]) -> dict:
  return {'loss': [r['loss'] for r in records if 'loss' in r],
          'eval': {str(r['step']): {k: r[k] for k in ('eval_loss', 'eval_bits_per_byte')}
                   for r in records if 'eval_loss' in r}}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='base or finetune')
  args = parser.parse_args()
  import jax

  from training import loop
  OUT.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    os.environ.setdefault('TFDS_DATA_DIR', str(scratch / 'tfds'))
    runs = {'base': lambda: base_config(scratch / 'base'),
            'finetune': lambda: finetune_config(scratch / 'finetune', *finetune_inputs(scratch))}
    for name, make in runs.items():
      if args.only and args.only != name:
        continue
      config = make()
      found = curve(loop.run(config))
      assert len(found['loss']) == config.train_steps, len(found['loss'])
      result = {'config': f'configs/{"base.py" if name == "base" else "finetune.py"}',
                'train_steps': config.train_steps, 'devices': jax.device_count(),
                'platform': jax.devices()[0].platform, 'jax': jax.__version__, **found,
                'command': 'python scripts/loss_curves.py' + (f' --only={name}' if args.only
                                                               else '')}
      (OUT / f'{name}.json').write_text(json.dumps(result, indent=1) + '\n')
      print(f'{name}: loss {found["loss"][0]:.4f} → {found["loss"][-1]:.4f} over '
            f'{len(found["loss"])} steps; eval {found["eval"]}')


if __name__ == '__main__':
  main()
