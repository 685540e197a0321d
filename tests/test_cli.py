"""Mistakes in the settings end train.py, sample.py, export.py and evaluate.py with one line
naming the flag or file and the fix, exit status 2, no traceback (runtime/cli.py)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_bad_settings_print_one_line_and_exit_2(tmp_path):
  (tmp_path / 'syntax.py').write_text('def get_config(:\n')
  (tmp_path / 'no_get.py').write_text('x = 1\n')
  (tmp_path / 'raises.py').write_text('raise RuntimeError("no GPU quota")\n')
  (tmp_path / 'key.py').write_text('def get_config():\n  return {}["nope"]\n')
  (tmp_path / 'typo.py').write_text('from configs import base\n\n\ndef get_config():\n'
                                    '  c = base.get_config()\n  c.modle.d_model = 3\n  return c\n')
  (tmp_path / 'new_field.py').write_text('from configs import base\n\n\ndef get_config():\n'
                                         '  c = base.get_config()\n  c.optimizer.lr = 3e-4\n'
                                         '  return c\n')
  kept = tmp_path / 'results.json'  # an evaluation's output that must not be overwritten
  kept.write_text('{"kept": true}\n')
  truncated, not_json = tmp_path / 'hf-truncated', tmp_path / 'hf-not-json'
  for copy in (truncated, not_json):
    shutil.copytree(REPO / 'tests/data/hf-llama-untied', copy)
  weights = (truncated / 'model.safetensors').read_bytes()
  (truncated / 'model.safetensors').write_bytes(weights[:len(weights) // 2])
  (not_json / 'config.json').write_text('{"vocab_size": 384,')
  workdir = f'--config.workdir={tmp_path / "run"}'
  cases = {  # arguments: what the one line must say
      ('train.py', '--config=configs/base.py', '--config.train_step=5'):
          "error: --config.train_step: the config has no setting 'train_step'; did you mean "
          'train_steps? (configs/base.py lists every setting)',
      ('train.py', '--config=configs/base.py', '--config.model.n_layer=3'):
          "error: --config.model.n_layer: the config has no setting 'n_layer'; did you mean "
          'n_layers?',
      ('train.py', '--config=configs/nope.py'):
          'error: --config=configs/nope.py: no such config file',
      ('train.py', f'--config={tmp_path / "syntax.py"}'):
          f'error: --config={tmp_path / "syntax.py"}: the config file does not parse: invalid '
          'syntax (line 1)',
      ('train.py', f'--config={tmp_path / "no_get.py"}'):
          f'error: --config={tmp_path / "no_get.py"}: the config file has no get_config()',
      ('train.py', '--config=configs/llama.py:3b'):
          "error: --config=configs/llama.py:3b: configs/llama.py: unknown preset '3b'; use one of",
      ('train.py', f'--config={tmp_path / "raises.py"}'):
          f'error: --config={tmp_path / "raises.py"}: the config file raises RuntimeError: no GPU '
          'quota (line 1, at import); fix the file',
      ('train.py', f'--config={tmp_path / "key.py"}'):  # not an override the user never gave
          f"error: --config={tmp_path / 'key.py'}: the config file raises KeyError: 'nope' (line "
          '2, in get_config()); fix the file',
      ('train.py', f'--config={tmp_path / "typo.py"}'):
          f"error: --config={tmp_path / 'typo.py'}: the config file raises AttributeError: "
          "'modle'; Did you mean \"model\" instead of \"modle\"? (line 6, in get_config())",
      ('train.py', f'--config={tmp_path / "new_field.py"}', workdir):
          'error: config.optimizer.lr is not a setting meshlm has (configs/base.py lists every '
          'setting); fix the config file',
      ('train.py', '--config=configs/nope.py', '--config.train_steps=3'):
          'error: --config=configs/nope.py: no such config file',
      ('train.py', '--config=configs/base.py', workdir, f'--config.init_from=hf:{truncated}'):
          f'error: config.init_from=hf:{truncated}: {truncated}/model.safetensors does not read ('
          'Error while deserializing header',
      ('train.py', '--config=configs/base.py', workdir, f'--config.init_from=hf:{not_json}'):
          f'error: config.init_from=hf:{not_json}: its config.json is not JSON (',
      ('train.py', '--config=configs/base.py', workdir, '--config.init_from=/nonexistent'):
          "error: config.init_from='/nonexistent' holds no checkpoint",
      ('sample.py', f'--workdir={tmp_path}', '--temperature=-1'):  # checked before loading
          'error: --temperature=-1.0 must be a finite number ≥ 0 (0: greedy)',
      ('sample.py', f'--workdir={tmp_path}', '--max_new_tokens=0'):
          'error: --max_new_tokens=0 must be at least 1',
      ('-m', 'data.train_tokenizer', '--config=configs/default.py', '--vocab_size=100',
       f'--output={tmp_path / "spm"}'):
          'error: --vocab_size=100 must be at least 260',
      ('train.py', '--config=configs/base.py', workdir, '--config.mesh.data=3'):
          'error: config.mesh: the fixed axes multiply to 3, which does not divide the 8 devices',
      ('train.py', '--config=configs/base.py', workdir, '--config.mesh.expert=2'):
          'error: config.mesh.expert=2 splits the experts of an MoE model, and '
          'config.model.experts=0; use config.mesh.fsdp for a dense model',
      ('train.py', '--config=configs/base.py', workdir, '--config.data.name=no_such_dataset'):
          "error: config.data.name='no_such_dataset': no such TFDS dataset in "
          'config.data.data_dir=',
      ('train.py', '--config=configs/base.py', workdir, '--config.model.d_model=128',
       '--config.init_from=hf:tests/data/hf-llama-untied'):
          'error: config.model.d_model=128, but config.init_from=hf:tests/data/hf-llama-untied '
          'has hidden_size=64 in its config.json; drop the setting',
      ('export.py', f'--workdir={tmp_path}', f'--output={tmp_path}'):
          f'error: --output={tmp_path} exists and is not an empty directory',
      ('train.py', '--config=configs/base.py', workdir, '--config.optimizer.learning_rate=nan'):
          'error: config.optimizer.learning_rate=nan is not a number a run can use; give a '
          'finite one',
      ('train.py', '--config=configs/base.py', workdir, '--config.loss.z_loss=inf'):
          'error: config.loss.z_loss=inf is not a number a run can use',
      ('evaluate.py', '--tasks=stdlib_next_line'):
          "error: --workdir is required (A run's workdir, checkpoints/ or checkpoints/STEP.)",
      ('evaluate.py', f'--workdir={tmp_path}', '--tasks=stdlib_next_line', '--batch_size=0'):
          'error: --batch_size=0 must be at least 1 and --limit=0 at least 0 (0: every example)',
      ('evaluate.py', f'--workdir={tmp_path}', '--tasks=stdlib_next_line', '--log_samples'):
          'error: --log_samples needs --output=FILE to write them to',
      ('evaluate.py', f'--workdir={tmp_path}', '--tasks=stdlib_next_line', f'--output={kept}'):
          f'error: --output={kept} exists; name a new file (nothing is overwritten)',
      ('train.py', '--config=configs/base.py', workdir, '--config.lm_eval.tasks=no_such_task'):
          'error: config.lm_eval.tasks: no lm-eval task named no_such_task',
      ('sample.py', '--prompt=x'):
          "error: --workdir is required (A run's workdir, checkpoints/ or checkpoints/STEP.)",
      ('sample.py', f'--workdir={tmp_path}'):
          f"error: --workdir='{tmp_path}' holds no checkpoint",
  }
  processes = {args: subprocess.Popen([sys.executable, *args], cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for args in cases}
  for args, expected in cases.items():
    out, err = processes[args].communicate(timeout=300)
    lines = [line for line in err.splitlines() if line.strip()]
    assert processes[args].returncode == 2, (args, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith(expected), (args, err[-2000:])
  assert not (tmp_path / 'run').exists()  # nothing was created for the refused runs
  assert kept.read_text() == '{"kept": true}\n'


def test_an_empty_workdir_is_refused_and_nothing_lands_in_the_current_directory(tmp_path):
  """Empty, the workdir would be the current directory: checkpoints, metrics, events and the lock
  among the user's files."""
  here = tmp_path / 'here'
  here.mkdir()
  result = subprocess.run([sys.executable, str(REPO / 'train.py'),
                           f'--config={REPO / "configs/base.py"}', '--config.workdir='],
                          cwd=here, capture_output=True, text=True, timeout=300)
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert lines[0].startswith('error: config.workdir is empty; give the run a directory of its own')
  assert not list(here.iterdir())

