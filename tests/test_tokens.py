"""Token ids prepared once (data/tokens.py): the batches are exactly those of tokenizing on the
fly, for any number of processes and workers, across epochs and a resume; what a prepared set
depends on prepares a new one; an interrupted preparation leaves nothing, a killed one nothing a
run reads; a run's losses are unchanged."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from data import corpus as corpus_lib
from data import chat, pipeline, tokenizers, tokens, train_tokenizer
from data.packing import ROW_KEYS
from runtime import faults
from training import loop
from tests.conftest import tiny_config
from tests.test_data import one_device_sharding


@pytest.fixture(scope='module')
def bpe(small_corpus, tmp_path_factory):
  """A byte-level BPE of 1,000 ids trained on the small corpus (data/train_tokenizer.py)."""
  texts = [small_corpus.train[i]['text'].decode() for i in range(len(small_corpus.train))]
  return tokenizers.HFTokenizer(train_tokenizer.train_hf(
      texts, 1000, tmp_path_factory.mktemp('bpe')))


def prepared(corpus, tokenizer, data_dir) -> tokens.Documents:
  config = tiny_config()
  config.data.tokenize = 'once'
  return tokens.load(corpus, tokenizer, config.data, str(data_dir))


def batches(source, n, rows=None, workers=0, state=None, batch_size=8, seq_len=4096):
  b = pipeline.Batches(pipeline.documents(source, seed=0), batch_sharding=one_device_sharding(),
                       batch_size=batch_size, seq_len=seq_len, pad_id=0, workers=workers,
                       rows=rows, state=state)
  out = [b.next_local() for _ in range(n)]
  state = b.state()
  b.close()
  return out, state


@pytest.mark.integration
def test_prepared_batches_equal_tokenizing_on_the_fly(small_corpus, bpe, tmp_path):
  docs = prepared(small_corpus, bpe, tmp_path)
  assert isinstance(docs.train, tokens.Prepared) and 'prepared in' in docs.description
  assert bpe.fingerprint in pathlib.Path(docs.train.path).parent.name
  assert docs.train.dtype == 'uint16'  # 1,000 ids: two bytes each
  on_the_fly = tokens.OnTheFly(small_corpus.train, 'text', chat.Encoder(bpe))
  n = len(on_the_fly)
  expected = on_the_fly.get(range(n))
  assert all(np.array_equal(a, b) for a, b in zip(docs.train.get(range(n)), expected))
  reference, state = batches(on_the_fly, 12)
  assert sum(s['docs_started'] for s in state['lanes']) > 2 * n  # into a third epoch
  # This process's rows as 2 and as 4 processes build them, and 2 workers.
  for shares in ([range(0, 4), range(4, 8)], [range(2 * p, 2 * p + 2) for p in range(4)]):
    parts = [batches(docs.train, 12, rows=list(rows))[0] for rows in shares]
    for step in range(12):
      for k in ROW_KEYS:
        whole = np.concatenate([part[step][k] for part in parts])
        np.testing.assert_array_equal(whole, reference[step][k])
  with_workers, _ = batches(docs.train, 12, workers=2)
  first, saved = batches(docs.train, 7)
  rest, _ = batches(docs.train, 5, state=saved)  # a resumed run goes on exactly
  for got in (with_workers, first + rest):
    for step, want in zip(got, reference):
      for k in ROW_KEYS:
        np.testing.assert_array_equal(step[k], want[k])


def test_another_tokenizer_or_an_edited_corpus_is_prepared_afresh(tmp_path):
  config = tiny_config()
  config.data.paths = str(tmp_path / 'corpus')
  config.data.data_dir = str(tmp_path / 'tfds')
  (tmp_path / 'corpus').mkdir()
  for name, text in (('a.txt', 'alpha beta gamma\n' * 50), ('b.txt', 'delta epsilon\n' * 40)):
    (tmp_path / 'corpus' / name).write_text(text)
  corpus = corpus_lib.load(config.data)
  first = train_tokenizer.train_hf(['alpha beta gamma delta epsilon'], 300, tmp_path / 'one')
  second = train_tokenizer.train_hf(['alpha beta gamma delta epsilon'], 280, tmp_path / 'two')
  dirs = {pathlib.Path(prepared(corpus, tokenizers.HFTokenizer(path), config.data.data_dir)
                       .train.path).parent for path in (first, second)}
  assert len(dirs) == 2  # one set of ids per tokenizer
  again = prepared(corpus, tokenizers.HFTokenizer(first), config.data.data_dir)
  assert pathlib.Path(again.train.path).parent in dirs  # and the same one is reused
  # An edited corpus is a new prepared corpus, and its ids a new set: the new text's.
  edited = 'zeta eta theta\n' * 30
  for name in ('a.txt', 'b.txt'):
    (tmp_path / 'corpus' / name).write_text(edited)
  corpus = corpus_lib.load(config.data)
  tok = tokenizers.HFTokenizer(first)
  docs = prepared(corpus, tok, config.data.data_dir)
  assert pathlib.Path(docs.train.path).parent not in dirs
  assert tok.decode(docs.train.get([0])[0][1:-1]) == edited


def test_an_interrupted_preparation_leaves_nothing_and_a_damaged_one_is_named(
    small_corpus, bpe, tmp_path, monkeypatch):
  calls = []

  def interrupted(texts):
    calls.append(len(texts))
    if len(calls) == 2:
      raise KeyboardInterrupt  # Ctrl-C midway, in the second batch of documents
    return type(bpe).encode_batch(bpe, texts)

  monkeypatch.setattr(bpe, 'encode_batch', interrupted)
  monkeypatch.setattr(tokens, 'BATCH', 4)
  with pytest.raises(KeyboardInterrupt):
    prepared(small_corpus, bpe, tmp_path)
  assert [p for p in tmp_path.rglob('*') if p.is_file()] == []
  monkeypatch.undo()
  docs = prepared(small_corpus, bpe, tmp_path)  # a later run prepares them afresh
  path = pathlib.Path(docs.validation.path)
  with open(path, 'r+b') as f:
    f.truncate(path.stat().st_size // 2)
  with pytest.raises(faults.Fault, match=rf'config.data: the prepared token ids in '
                                          rf'{path.parent} are damaged; delete that directory'):
    prepared(small_corpus, bpe, tmp_path)


KILLED = """
import sys, time
from configs import base
from data import chat, corpus as corpus_lib, tokenizers, tokens

class Slow(tokenizers.ByteTokenizer):
  def encode_batch(self, texts):
    time.sleep(0.1)
    return super().encode_batch(texts)

config = base.get_config().data
config.paths, config.validation_fraction = sys.argv[1], float(sys.argv[3])
tokens.BATCH = 1
tokens.prepare(corpus_lib.load(config), chat.Encoder(Slow()), sys.argv[2])
"""


def test_a_killed_preparation_is_never_read_and_the_next_prepares_afresh(tmp_path):
  """SIGKILL midway, so nothing could clean up: what it wrote stays in its incomplete folder."""
  config = tiny_config()
  process = subprocess.Popen([sys.executable, '-c', KILLED, config.data.paths, str(tmp_path),
                              str(config.data.validation_fraction)],
                             cwd=pathlib.Path(__file__).parent.parent)
  deadline = time.monotonic() + 60
  while not list(tmp_path.glob('meshlm_tokens/incomplete-*/train.array_record')):
    assert process.poll() is None and time.monotonic() < deadline, 'it never started writing'
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  left, = (tmp_path / 'meshlm_tokens').iterdir()
  corpus = corpus_lib.load(config.data)
  docs = prepared(corpus, tokenizers.ByteTokenizer(), tmp_path)  # same fingerprint: afresh
  assert left.name.startswith(f'incomplete-{pathlib.Path(docs.train.path).parent.name}-')
  expected = tokens.OnTheFly(corpus.train, 'text', chat.Encoder(tokenizers.ByteTokenizer()))
  n = len(expected)
  assert all(np.array_equal(a, b) for a, b in zip(docs.train.get(range(n)),
                                                  expected.get(range(n))))


@pytest.mark.integration
def test_a_run_on_prepared_ids_has_the_losses_of_one_tokenizing_on_the_fly(bpe, tmp_path):
  records = {}
  for mode in ('once', 'on_the_fly'):
    config = tiny_config(fsdp=8)
    config.data.tokenizer, config.data.tokenizer_model = 'hf', bpe.path
    config.model.vocab_size, config.model.head_chunk = 0, 64  # 1,024 ids
    config.data.tokenize = mode
    config.train_steps, config.eval_every, config.eval_batches = 2, 2, 2
    config.workdir = str(tmp_path / mode)
    records[mode] = [{k: v for k, v in r.items() if 'loss' in k or k.startswith('eval_')}
                     for r in loop.run(config)]
  assert records['once'] == records['on_the_fly'] and 'eval_bits_per_byte' in records['once'][-1]
  prepared_dirs = list(pathlib.Path(os.environ['TFDS_DATA_DIR']).glob('meshlm_tokens/*'))
  assert any(bpe.fingerprint in d.name for d in prepared_dirs)
