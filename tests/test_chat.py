"""Fine-tuning data (data/records.py, data/chat.py): JSON Lines, gzip and Parquet records prepared
as text files are, bad records counted and named; chat templates rendered and tokenized as
transformers does (goldens made by tests/data/make_chat_goldens.py); the answers' weights through
packing, prepared or on the fly, and into evaluation."""

import gzip
import importlib
import json
import pathlib
import shlex
import subprocess
import sys
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import base
from data import chat, corpus as corpus_lib, records, tokenizers, tokens
from data.packing import Lane
from runtime import faults
from training import loop
from tests.conftest import tiny_config

FALLBACK = chat.Template(chat.FALLBACK, 'the fallback template')

REPO = pathlib.Path(__file__).resolve().parents[1]
CHAT = REPO / 'tests' / 'data' / 'hf-chat'
GOLDENS = json.loads((CHAT / 'goldens.json').read_text())
TEMPLATES = ('llama3', 'chatml', 'gemma', 'generation')


def conversation(i: int) -> list[dict]:
  a, b = i % 17 + 3, i % 11 + 5
  return [{'role': 'system', 'content': 'Add.'} if i % 3 == 0 else None,
          {'role': 'user', 'content': f'What is {a} + {b}?'},
          {'role': 'assistant', 'content': f'{a} + {b} = {a + b}.'},
          {'role': 'user', 'content': 'Twice that?'},
          {'role': 'assistant', 'content': f'{2 * (a + b)}'}]


def chat_records(n: int) -> list[dict]:
  return [{'messages': [m for m in conversation(i) if m]} for i in range(n)]


def write_jsonl(path: pathlib.Path, rows, bad_lines=()) -> pathlib.Path:
  lines = [json.dumps(r) for r in rows]
  for index, line in bad_lines:
    lines.insert(index, line)
  text = '\n'.join(lines) + '\n'
  if path.name.endswith('.gz'):
    with gzip.open(path, 'wt', encoding='utf-8') as f:
      f.write(text)
  else:
    path.write_text(text)
  return path


def config_for(paths, data_dir, record='messages'):
  config = tiny_config(fsdp=8)
  config.data.paths, config.data.data_dir, config.data.record = str(paths), str(data_dir), record
  config.data.validation_fraction = 0.2
  return config


def documents(split) -> list[str]:
  return sorted(split[i]['text'].decode() for i in range(len(split)))


@pytest.mark.parametrize('name', TEMPLATES)
def test_chat_templates_render_and_tokenize_as_transformers_does(name):
  """The text, the generation prompt and the ids are transformers' own; the answers are what
  its {% generation %} mask marks where a template has one; the weighted tokens decode to the
  assistant's turns (and the template's end of turn)."""
  tok = tokenizers.HFTokenizer(str(CHAT / name / 'tokenizer.json'))
  encode = chat.Encoder(tok, 'messages', chat.template_source(tok, 'auto'))
  assert tok.chat_template and 'fallback' not in encode.origin
  for messages, want in zip(GOLDENS['conversations'], GOLDENS[name]):
    text, spans = chat.answer_spans(tok.chat_template, messages, tok.special_tokens)
    assert text == want['text']
    assert chat.render(tok.chat_template, messages[:-1], tok.special_tokens, True) == want['prompt']
    document, = encode([json.dumps({'messages': messages}).encode()])
    ids, weights = chat.ids_and_weights(document)
    assert ids[-1] == tok.eos_id  # the document's end; it starts as the template renders it
    inner = slice(0, len(ids) - 1)  # (BOS or not) as transformers' apply_chat_template does
    assert ids[inner].tolist() == want['ids']
    if 'assistant_masks' in want:
      assert weights[inner].tolist() == want['assistant_masks']
    answers = [m['content'] for m in messages if m['role'] == 'assistant']
    trained = tok.decode(ids[weights == 1])
    assert [a.strip() for a in answers] == [a.strip() for a in answers if a.strip() in trained]
    for m in messages:
      if m['role'] != 'assistant':
        assert m['content'] not in trained
    assert weights[-1] == weights[-2]  # the EOS added after an answer is trained on


def test_answer_weights_survive_packing_cut_anywhere():
  """The fallback template on bytes: a pair weighs what its target does, whether a row holds
  several conversations or one is cut across rows; and train_on='all' weighs every pair."""
  encode = chat.Encoder(tokenizers.ByteTokenizer(), 'messages', FALLBACK)
  stored = [json.dumps(r).encode() for r in chat_records(6)]
  docs = encode(stored)
  assert all(d.ndim == 2 for d in docs)
  for d, r in zip(docs, chat_records(6)):
    trained = bytes(int(t) for t, w in zip(*d) if w and t < 256).decode()
    assert trained == ''.join(m['content'] + '<|im_end|>\n' for m in r['messages']
                              if m['role'] == 'assistant')
  targets = np.concatenate([d[1, 1:] for d in docs])
  for seq_len in (7, 64, 1024):
    lane = Lane(lambda g: docs[g] if g < len(docs) else None, 0, 1, seq_len, 258)
    rows = [lane.next_row() for _ in range(-(-sum(d.shape[1] - 1 for d in docs) // seq_len))]
    weights = np.concatenate([r['weights'][r['segment_ids'] > 0] for r in rows])
    np.testing.assert_array_equal(weights, targets)
  everything = chat.Encoder(tokenizers.ByteTokenizer(), 'messages', FALLBACK, 'all')(stored)
  assert all(d.ndim == 1 for d in everything)
  np.testing.assert_array_equal(everything[0], docs[0][0])


def test_a_prompt_and_completion_trains_on_the_completion_and_its_end():
  tok = tokenizers.HFTokenizer(str(CHAT / 'llama3' / 'tokenizer.json'))
  document, = chat.Encoder(tok, 'prompt_completion')(
      [json.dumps({'prompt': 'Q: two plus two?\nA:', 'completion': ' four'}).encode()])
  ids, weights = chat.ids_and_weights(document)
  assert tok.decode(ids[weights == 1]) == ' four' and ids[-1] == tok.eos_id and weights[-1] == 1
  assert ids.tolist() == [tok.bos_id, *tok.encode('Q: two plus two?\nA: four'.encode()),
                          tok.eos_id]


def test_jsonl_gzip_and_parquet_records_prepare_alike_with_bad_records_counted(tmp_path):
  """Each format holds the same 30 good records and 4 bad ones; each bad one is counted in one
  warning naming the file and the first bad line or row; the good ones are the documents, split
  by their content, whatever the file."""
  rows = chat_records(30)
  bad = [{'messages': []}, {'chat': rows[0]['messages']},
         {'messages': [{'role': 'user', 'content': 'no answer'}]},
         {'messages': [{'role': 'robot', 'content': 'x'}, rows[0]['messages'][-1]]}]
  for folder in 'abc':
    (tmp_path / folder).mkdir()
  jsonl = write_jsonl(tmp_path / 'a' / 'chat.jsonl', rows + bad[1:], bad_lines=[(3, '{not json')])
  gz = write_jsonl(tmp_path / 'b' / 'chat.jsonl.gz', bad + rows)
  pq.write_table(pa.Table.from_pylist(
      [{'messages': r['messages']} for r in rows] + [{'messages': None}] * 4),
      tmp_path / 'c' / 'chat.parquet')
  prepared = {}
  for path, first in ((jsonl, 'line 4: not JSON'), (gz, "line 1: field 'messages' is not a "
                                                         'non-empty list'),
                      (tmp_path / 'c' / 'chat.parquet', "row 31: field 'messages' is not")):
    with pytest.warns(corpus_lib.DataWarning) as caught:
      corpus = corpus_lib.load(config_for(path, tmp_path / 'tfds').data)
    message, = [str(w.message) for w in caught]
    assert message.startswith(f'config.data.paths: {path}: skipped 4 of 34 records ({first}')
    assert corpus.record == 'messages' and len(corpus.train) + len(corpus.validation) == 30
    prepared[path.suffix] = (documents(corpus.train), documents(corpus.validation))
  assert len(set(map(str, prepared.values()))) == 1 and prepared['.gz'][1]
  assert json.loads(prepared['.gz'][0][0]) in rows
  with warnings.catch_warnings():  # prepared once: a second load reads it
    warnings.simplefilter('error')
    corpus_lib.load(config_for(jsonl, tmp_path / 'tfds').data)


def test_record_settings_and_files_that_hold_nothing_are_one_clear_error(tmp_path):
  rows = write_jsonl(tmp_path / 'rows.jsonl', [{'text': f'document {i}'} for i in range(5)])
  with pytest.raises(ValueError, match=r"none of the 5 records .* config.data.record='messages' "
                                       r"reads \(first: line 1: no field 'messages'\)"):
    corpus_lib.load(config_for(rows, tmp_path / 'tfds').data)
  corpus = corpus_lib.load(config_for(rows, tmp_path / 'tfds', record='text').data)
  assert sorted(documents(corpus.train) + documents(corpus.validation)) == sorted(
      f'document {i}' for i in range(5))
  (tmp_path / 'notes.txt').write_text('a text file')
  mixed = config_for(f'{rows},{tmp_path / "notes.txt"}', tmp_path / 'tfds')
  with pytest.raises(ValueError, match=r"config.data.record='messages' reads records .* also "
                                       r'holds .*notes.txt'):
    corpus_lib.check_source(mixed.data)
  broken = tmp_path / 'broken.jsonl.gz'
  broken.write_bytes(b'not gzip at all')
  with pytest.raises(ValueError, match=r'broken.jsonl.gz cannot be read as UTF-8 JSON Lines '
                                       r'\(gzip\)'):
    corpus_lib.load(config_for(broken, tmp_path / 'tfds').data)
  for field, value, match in (('record', 'chat', 'config.data.record'),
                              ('train_on', 'prompts', 'config.data.train_on'),
                              ('chat_template', '/no/such.jinja', 'config.data.chat_template'),
                              ('messages_field', '', 'config.data.messages_field'),
                              ('name', 'lm1b', "a named TFDS dataset .*config.data.name='lm1b'")):
    config = config_for(rows, tmp_path / 'tfds')
    config.data[field] = value
    with pytest.raises(ValueError, match=match):
      data = base.DataConfig(**config.data)  # checks each value against its declaration
      tokens.check_settings(data)
      chat.owned(tokenizers.ByteTokenizer(), data, None)


def test_an_interrupted_record_preparation_leaves_nothing(tmp_path, monkeypatch):
  path = write_jsonl(tmp_path / 'chat.jsonl', chat_records(20))
  config = config_for(path, tmp_path / 'tfds')
  real, calls = records.read, []

  def interrupted(file, fields, renders=None):
    calls.append(file)
    for i, item in enumerate(real(file, fields, renders)):
      if len(calls) == 2 and i == 5:  # the scan passes; preparing the train split stops
        raise KeyboardInterrupt
      yield item

  monkeypatch.setattr(records, 'read', interrupted)
  with pytest.raises(KeyboardInterrupt):
    corpus_lib.load(config.data)
  assert [p for p in (tmp_path / 'tfds').rglob('*') if p.is_file()] == []
  monkeypatch.undo()
  corpus = corpus_lib.load(config.data)
  assert len(corpus.train) + len(corpus.validation) == 20


@pytest.mark.integration
def test_prepared_chat_ids_carry_their_weights_and_a_run_evaluates_only_answers(tmp_path):
  """Ids prepared once equal those encoded on the fly, weights and all; a short run on the chat
  corpus trains, and its evaluation counts the answers' tokens only."""
  path = write_jsonl(tmp_path / 'chat.jsonl', chat_records(40))
  config = config_for(path, tmp_path / 'tfds')
  config.data.tokenizer = 'hf'
  config.data.tokenizer_model = str(CHAT / 'llama3' / 'tokenizer.json')
  config.data.tokenize = 'once'
  tok = tokenizers.load(config.data)
  corpus = corpus_lib.load(config.data)
  template = chat.owned(tok, config.data, None)
  docs = tokens.load(corpus, tok, config.data, str(tmp_path / 'tfds'), template)
  assert isinstance(docs.validation, tokens.Prepared)
  fly = tokens.OnTheFly(corpus.validation, 'text',
                        tokens.encoder(corpus, tok, config.data, template))
  n = len(fly)
  want = fly.get(range(n))
  assert all(d.ndim == 2 for d in want)
  assert all(np.array_equal(a, b) for a, b in zip(docs.validation.get(range(n)), want))
  config.train_steps, config.eval_every, config.eval_batches = 2, 2, 0
  config.workdir = str(tmp_path / 'run')
  records_ = loop.run(config)
  assert records_[-1]['eval_tokens'] == sum(int(d[1].sum()) for d in want)
  assert np.isfinite(records_[-1]['eval_loss'])
  kept = pathlib.Path(config.workdir) / 'tokenizer'  # the run's own copy of its tokenizer
  assert sorted(p.name for p in kept.iterdir()) == ['tokenizer.json', 'tokenizer_config.json']
  assert tokenizers.HFTokenizer(str(kept / 'tokenizer.json')).fingerprint == tok.fingerprint


def walkthrough_commands(tmp_path) -> list[str]:
  """configs/finetune.py's commands as its docstring gives them, in tmp_path: its warmup's 10
  steps, each logged."""
  doc = importlib.import_module('configs.finetune').__doc__
  block = doc.split('Run,')[1].split('Should reach')[0].split(':\n', 1)[1]
  commands = block.replace('\\\n', ' ').replace('/tmp/', f'{tmp_path}/').splitlines()
  commands = [' '.join(c.split()) for c in commands if c.strip()]
  return [c + ' --config.train_steps=10 --config.eval_every=10 --config.checkpoint_every=10'
          ' --config.log_every=1' if 'train.py' in c else c for c in commands]


@pytest.mark.integration
def test_the_walkthrough_fine_tunes_an_imported_model_and_exports_it(tmp_path):
  """The preset's docstring, run as a user would (fewer steps): LoRA on the imported
  model; the merged export holds the tokenizer with its chat template and the context it was
  trained at; the PEFT export is the adapters; and where transformers and peft are installed, the
  base with the PEFT adapter computes what the merged export does."""
  commands = walkthrough_commands(tmp_path)
  assert [c.split()[:2] for c in commands] == [
      ['python', '-m'], ['cp', '-r'], ['python', 'train.py'], ['python', 'export.py'],
      ['python', 'export.py'], ['python', 'sample.py']]
  script = '\n'.join([f'python() {{ {shlex.quote(sys.executable)} "$@"; }}', *commands])
  done = subprocess.run(['bash', '-e', '-c', script], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "--- prompt 'What does `json.dumps(obj)` do?'" in done.stdout
  exported = tmp_path / 'tiny-llama-tuned'
  # fine-tuned past the imported 128 positions: it declares the 256 it was trained at, and said so
  assert json.loads((exported / 'config.json').read_text())['max_position_embeddings'] == 256
  assert 'past the 128 positions the model was trained for' in done.stderr
  config = json.loads((exported / 'tokenizer_config.json').read_text())
  assert config['chat_template'] == json.loads(
      (CHAT / 'llama3' / 'tokenizer_config.json').read_text())['chat_template']
  metrics = [json.loads(line) for line in (tmp_path / 'meshlm-finetune' / 'metrics.jsonl').open()]
  assert metrics[-1]['eval_tokens'] > 0 and metrics[-1]['step'] == 10
  # Its steps are the warmup's (the same schedule as 150 steps': optimizer.make_schedule), so they
  # are the first 10 of the preset's committed curve, made on one device (scripts/loss_curves.py).
  curve = json.loads((REPO / 'tests' / 'data' / 'curves' / 'finetune.json').read_text())
  np.testing.assert_allclose([r['loss'] for r in metrics if 'loss' in r], curve['loss'][:10],
                             atol=1e-3, rtol=0)
  adapter = tmp_path / 'tiny-llama-adapter'
  assert json.loads((adapter / 'adapter_config.json').read_text())['r'] == 16
  assert (adapter / 'adapter_model.safetensors').is_file()
  try:
    import peft
    import torch
    import transformers
  except ImportError:
    return  # CI has no torch: tests/test_lora.py's PEFT goldens stand in
  tokens = torch.arange(40).reshape(2, 20)
  merged = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'tiny-llama').eval()
  adapted = peft.PeftModel.from_pretrained(base, adapter).eval()
  with torch.no_grad():
    np.testing.assert_allclose(adapted(tokens).logits.numpy(), merged(tokens).logits.numpy(),
                               atol=1e-4)


def test_a_conversation_starts_as_its_template_renders_it_and_blank_answers_are_not_records(
    tmp_path):
  """No BOS before a template that writes none (the fallback's ChatML), as apply_chat_template
  gives a served model; every assistant turn blank is a bad record; a run's own template is
  kept and a changed one refused."""
  byte = tokenizers.ByteTokenizer()
  document, = chat.Encoder(byte, 'messages', FALLBACK)([json.dumps({'messages': [
      {'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'yo'}]}).encode()])
  ids, _ = chat.ids_and_weights(document)
  assert bytes(ids[:12].tolist()).decode() == '<|im_start|>' and ids[-1] == byte.eos_id
  fields = records.Fields('messages', 'text', 'prompt', 'completion', 'messages')
  with pytest.raises(records.BadRecord, match='every assistant message is blank'):
    records.stored({'messages': [{'role': 'user', 'content': 'hi'},
                                 {'role': 'assistant', 'content': ' \n'}]}, fields)
  template = tmp_path / 'mine.jinja'
  template.write_text(chat.FALLBACK)
  setting = tiny_config().data
  setting.record, setting.chat_template = 'messages', str(template)
  chat.keep_template(chat.owned(byte, setting, tmp_path).source, tmp_path)
  template.unlink()  # moved: the run has its own
  assert chat.owned(byte, setting, tmp_path).source == chat.FALLBACK
  template.write_text(chat.FALLBACK + ' ')
  with pytest.raises(ValueError, match=r'config.data.chat_template: .* is sha256:\w+ now, but '
                                       r'the run .* rendered its records with sha256:'):
    chat.owned(byte, setting, tmp_path)
  # The original as the run kept it, the copy edited: the copy is named, by its checkpoints' digest.
  template.write_text(chat.FALLBACK)
  (tmp_path / chat.KEPT).write_text(chat.FALLBACK + ' ')
  with pytest.raises(faults.Fault, match=rf'{tmp_path / chat.KEPT}: the chat template is sha256:'):
    chat.owned(byte, setting, tmp_path, recorded=chat.digest(chat.FALLBACK))
