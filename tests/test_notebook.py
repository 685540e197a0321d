"""The notebooks run from top to bottom (nbclient, a real Jupyter kernel) and show what they
promise: quickstart.ipynb the mesh, a falling loss, a plot, sampled text; finetune.ipynb a chat
corpus and its template, LoRA, the exports, an answer."""

import pathlib

import nbclient
import nbformat
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  monkeypatch.setenv('TMPDIR', str(tmp_path))  # its workdir (tempfile.mkdtemp), removed after
  notebook = nbformat.read(REPO / 'notebooks' / 'quickstart.ipynb', as_version=4)
  # 20 of its 100 steps, an evaluation every 10: configs/base.py's 100 steps are
  # tests/test_training.py's, against its committed curve. The kernel inherits this process's
  # environment: 8 CPU devices, the tests' TFDS data dir, and XLA's optimisations
  # (tests/conftest.py).
  settings_cell, = [c for c in notebook.cells if 'config.train_steps = 100' in c.source]
  settings_cell.source = settings_cell.source.replace(
      'config.train_steps = 100', 'config.train_steps = 20').replace(
      'config.eval_every = 50', 'config.eval_every = 10')
  nbclient.NotebookClient(notebook, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': str(REPO)}}).execute()
  outputs = [o for cell in notebook.cells if cell.cell_type == 'code' for o in cell.outputs]
  text = ''.join(o.get('text', '') for o in outputs)
  assert '8 cpu devices' in text
  assert "mesh: {'data': 1, 'stage': 1, 'fsdp': 8, 'expert': 1, 'tensor': 1, 'sequence': 1}" in text
  assert 'step 20/20' in text and 'eval_loss' in text
  first, last = map(float, text.split('loss ')[-1].split()[0:3:2])  # "loss A → B"
  assert last < first
  assert any('image/png' in o.get('data', {}) for o in outputs)
  assert "--- 'def '\ndef " in text and "--- 'import '\nimport " in text
  assert [p.name[:15] for p in tmp_path.iterdir()] == ['meshlm-notebook']


@pytest.mark.integration
def test_finetune_notebook_runs(tmp_path, monkeypatch):
  """notebooks/finetune.ipynb: records and their template, LoRA on the imported model, both
  exports, a chat answer."""
  monkeypatch.setenv('TMPDIR', str(tmp_path))  # its working folder, removed after
  notebook = nbformat.read(REPO / 'notebooks' / 'finetune.ipynb', as_version=4)
  nbclient.NotebookClient(notebook, timeout=600, kernel_name='python3',
                          resources={'metadata': {'path': str(REPO)}}).execute()
  text = ''.join(o.get('text', '') for cell in notebook.cells if cell.cell_type == 'code'
                 for o in cell.outputs)
  assert "template from: the chat template of" in text and ' trained on: ' in text
  assert 'adapters 32,768 parameters (trained), base 115,008 (frozen)' in text
  assert "Adam's moments of the adapters alone, 65,536 numbers" in text
  first, last = map(float, text.split('loss ')[-1].split(';')[0].split(' → '))
  assert last < first
  assert "'adapter_config.json', 'adapter_model.safetensors'" in text
  assert 'context limit declared: 256' in text and '<|start_header_id|>assistant' in text
  assert [p.name[:15] for p in tmp_path.iterdir()] == ['meshlm-finetune']
