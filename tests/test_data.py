"""The data pipeline: packing keeps every token once, batches depend only on the seed, resume is
exact, processes split the batch, tokenizers round-trip, and bad input fails early by name."""

import json
import math
import pathlib
import pickle
import tempfile

import jax
import numpy as np
import pytest

import sharding
from data import corpus as corpus_lib
from data import chat, pipeline, tokenizers, tokens, train_tokenizer
from data.packing import ROW_KEYS
from runtime import faults
from training import loop
from training import settings
from training.state import build
from tests.conftest import tiny_config

BYTES = tokenizers.ByteTokenizer()


def one_device_sharding():
  return sharding.batch_sharding(sharding.make_mesh(tiny_config().mesh, jax.devices()[:1]))


class Arrays(list):
  """Token arrays held in memory, as a source of documents (data/tokens.py)."""

  def get(self, indices):
    return [self[i] for i in indices]


def synthetic_docs(n=23, seed=0):
  """Documents of very different lengths (1 to 150 pairs), each token tagged with its document:
  token = 1000·doc + index, so any misplaced token is visible."""
  rng = np.random.default_rng(seed)
  lengths = rng.choice([2, 3, 17, 40, 64, 65, 151], size=n)
  return Arrays((1000 * d + np.arange(n_tok)).astype(np.int32) for d, n_tok in enumerate(lengths))


def pieces(rows_by_step):
  """Split rows into (lane, step, segment) pieces: (inputs, targets, positions)."""
  out = []
  for step, batch in enumerate(rows_by_step):
    for lane in range(batch['inputs'].shape[0]):
      seg = batch['segment_ids'][lane]
      for s in range(1, seg.max() + 1):
        where = seg == s
        assert np.all(np.flatnonzero(where) == np.arange(where.argmax(), where.argmax() +
                                                          where.sum()))  # contiguous
        out.append((lane, step, *(batch[k][lane][where] for k in ('inputs', 'targets',
                                                                   'positions'))))
  return out


def test_packing_keeps_every_pair_once_with_right_segments_and_positions():
  docs = synthetic_docs()
  B, L = 4, 32
  batches = pipeline.Batches(pipeline.documents(docs, seed=None),
                             batch_sharding=one_device_sharding(), batch_size=B, seq_len=L,
                             pad_id=-1, epochs=1)
  steps = [batches.next_local() for _ in range(60)]
  assert steps[-1]['weights'].sum() == 0  # the pass is over well before 60 steps
  seen = {}
  for lane, step, inputs, targets, positions in pieces(steps):
    d = int(inputs[0]) // 1000
    assert d % B == lane  # lane j reads documents j, j+B, ...
    np.testing.assert_array_equal(inputs // 1000, d)  # a segment never mixes documents
    np.testing.assert_array_equal(inputs % 1000, positions)  # positions count from the doc start
    np.testing.assert_array_equal(targets, inputs + 1)  # the target is the next token
    seen.setdefault(d, []).append((step, positions))
  for d, doc in enumerate(docs):
    chunks = sorted(seen[d], key=lambda x: x[0])
    got = np.concatenate([p for _, p in chunks])
    np.testing.assert_array_equal(got, np.arange(len(doc) - 1))  # every pair once, in order
    for (s0, p0), (s1, p1) in zip(chunks, chunks[1:]):
      assert s1 == s0 + 1 and p1[0] == p0[-1] + 1  # a split document continues in the next row
  for batch in steps:  # padding only after the data, weight 0, segment 0
    pad = batch['segment_ids'] == 0
    assert np.all(batch['weights'][pad] == 0) and np.all(batch['weights'][~pad] == 1)
    assert np.all(batch['inputs'][pad] == -1)


def test_training_rows_are_fully_packed_and_the_next_epoch_reshuffles():
  docs = synthetic_docs(n=8)
  source = pipeline.documents(docs, seed=3)
  first = lambda tokens: [int(t[0]) for t in tokens]
  assert sorted(first(source.get(range(8)))) == sorted(first(docs))
  assert first(source.get(range(8))) != first(source.get(range(8, 16)))
  assert sorted(first(source.get(range(8, 16)))) == sorted(first(docs))
  batches = pipeline.Batches(source, batch_sharding=one_device_sharding(), batch_size=2,
                             seq_len=16, pad_id=-1)
  assert all(batches.next_local()['weights'].all() for _ in range(50))  # no padding, endless


def train_batches(config, corpus, n, workers=0, state=None, rows=None, sharding_=None):
  docs = pipeline.documents(tokens.OnTheFly(corpus.train, corpus.text_key, chat.Encoder(BYTES)),
                            seed=config.seed)
  batches = pipeline.Batches(docs, batch_sharding=sharding_ or one_device_sharding(),
                             batch_size=config.batch_size, seq_len=config.seq_len,
                             pad_id=BYTES.pad_id, workers=workers, state=state, rows=rows)
  out = [batches.next_local() for _ in range(n)]
  saved = json.loads(json.dumps(batches.state()))  # it must survive being written as JSON
  batches.close()
  return out, saved


def assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for k in ROW_KEYS:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.integration
def test_same_seed_same_batches_for_any_number_of_workers(small_corpus):
  config = tiny_config()
  reference, _ = train_batches(config, small_corpus, 12)
  for workers in (1, 2):
    assert_same(train_batches(config, small_corpus, 12, workers=workers)[0], reference)
  config.seed = 1
  other, _ = train_batches(config, small_corpus, 12)
  assert not np.array_equal(other[0]['inputs'], reference[0]['inputs'])


@pytest.mark.integration
@pytest.mark.parametrize('workers', [0, 2])
def test_resume_from_saved_state_continues_exactly(small_corpus, workers):
  config = tiny_config()
  config.seq_len = 2048  # long rows, so the lanes cross documents before the stop
  uninterrupted, _ = train_batches(config, small_corpus, 30)
  first, state = train_batches(config, small_corpus, 17, workers=workers)
  assert sum(s['docs_started'] for s in state['lanes']) > config.batch_size  # docs were crossed
  rest, _ = train_batches(config, small_corpus, 13, workers=workers, state=state)
  assert_same(first + rest, uninterrupted)


@pytest.mark.parametrize('n_processes', [2, 4])
def test_process_shares_are_disjoint_and_rebuild_the_global_batch(small_corpus, n_processes):
  """Processes own consecutive blocks of devices; each builds only the rows its devices hold."""
  config = tiny_config(data=2, fsdp=2, tensor=2)
  batch_sharding = sharding.batch_sharding(build(settings.resolve(config)).mesh)
  devices = list(batch_sharding.mesh.devices.flat)
  per = len(devices) // n_processes
  shares = [pipeline.process_rows(batch_sharding, config.batch_size, config.seq_len,
                                  devices[p * per:(p + 1) * per]) for p in range(n_processes)]
  assert sorted(sum(shares, [])) == list(range(config.batch_size))  # disjoint, and they cover it
  reference, _ = train_batches(config, small_corpus, 5)
  built = [train_batches(config, small_corpus, 5, rows=rows, sharding_=batch_sharding)[0]
           for rows in shares]
  for step in range(5):
    for k in ROW_KEYS:
      whole = np.empty_like(reference[step][k])
      for rows, batches in zip(shares, built):
        whole[rows] = batches[step][k]
      np.testing.assert_array_equal(whole, reference[step][k])


def test_global_array_shards_hold_the_rows_the_pipeline_built(small_corpus):
  config = tiny_config(data=2, fsdp=2, sequence=2)
  batch_sharding = sharding.batch_sharding(build(settings.resolve(config)).mesh)
  docs = pipeline.documents(tokens.OnTheFly(small_corpus.train, 'text', chat.Encoder(BYTES)),
                            seed=0)
  batches = pipeline.Batches(docs, batch_sharding=batch_sharding, batch_size=8, seq_len=32,
                             pad_id=BYTES.pad_id)
  local = batches.next_local()
  arrays = batches.to_global(local)
  for k in ROW_KEYS:
    for shard in arrays[k].addressable_shards:
      np.testing.assert_array_equal(shard.data, local[k][shard.index])


@pytest.mark.integration
def test_a_full_eval_pass_reads_every_validation_token_and_reports_bits_per_byte(
    small_corpus, tmp_path):
  config = tiny_config(fsdp=8)
  config.train_steps, config.eval_every, config.eval_batches = 2, 2, 0
  config.workdir = str(tmp_path)
  record = loop.run(config)[-1]
  texts = [small_corpus.validation[i]['text'] for i in range(len(small_corpus.validation))]
  assert record['eval_tokens'] == sum(len(t) + 1 for t in texts)  # every (input, target) pair
  n_bytes = sum(len(t) for t in texts)  # EOS targets carry loss but no bytes
  expected_bpb = record['eval_loss'] * record['eval_tokens'] / math.log(2) / n_bytes
  np.testing.assert_allclose(record['eval_bits_per_byte'], expected_bpb, rtol=1e-6)


TEXTS = {
    'a.py': 'def greet(name):\n    """Say hello — in Unicode: héllo, 你好."""\n    return f"hi {name}"\n',
    'b.txt': 'The quick brown fox jumps over the lazy dog.\n\n  Indented   spaces\tand tabs.\n' * 20,
    'sub/c.md': '# Title\n\n* item one\n* item two ✓\n\n```\ncode = 1  # comment\n```\n' * 10,
}


def write_texts(root: pathlib.Path, texts=TEXTS):
  for name, text in texts.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text, encoding='utf-8')
  return root


def test_sentencepiece_trains_on_the_corpus_and_round_trips_exactly(tmp_path):
  config = tiny_config()
  config.data.paths = str(write_texts(tmp_path / 'corpus'))
  config.data.data_dir = str(tmp_path / 'tfds')
  model = train_tokenizer.train(config.data, 400, str(tmp_path / 'spm' / 'm'))
  config.data.tokenizer, config.data.tokenizer_model = 'sentencepiece', model
  sp = tokenizers.load(config.data)
  assert sp.vocab_size == 400 and (sp.bos_id, sp.eos_id, sp.pad_id) == (1, 2, 3)
  for text in TEXTS.values():
    ids = sp.encode(text.encode())
    assert sp.decode(ids) == text  # lossless, whitespace and Unicode included
    assert sp.token_bytes()[ids].sum() == len(text.encode())
  assert len(sp.encode(TEXTS['b.txt'].encode())) < len(TEXTS['b.txt']) / 2  # it compresses
  config.model.vocab_size = 0
  assert tokenizers.model_vocab_size(0, sp) == 512  # padded to 128s
  assert_rows_decode_to_the_documents(config, sp)


def assert_rows_decode_to_the_documents(config, tokenizer):
  """Through the pipeline: the packed rows' targets decode back to the training documents."""
  corpus = corpus_lib.load(config.data)
  docs = pipeline.documents(tokens.OnTheFly(corpus.train, 'text', chat.Encoder(tokenizer)),
                            seed=None)
  batches = pipeline.Batches(docs, batch_sharding=one_device_sharding(), batch_size=1,
                             seq_len=64, pad_id=tokenizer.pad_id, epochs=1)
  targets = np.concatenate([b['targets'][b['weights'] > 0] for b in
                            (batches.next_local() for _ in range(40))])
  text = tokenizer.decode(targets[targets != tokenizer.eos_id])
  assert text == ''.join(corpus.train[i]['text'].decode() for i in range(len(corpus.train)))


def hf_byte_level_bpe(directory: pathlib.Path, texts, vocab_size=600, config=True) -> str:
  """A byte-level BPE trained on `texts` by the `tokenizers` library, with Llama 3's special
  tokens named in its tokenizer_config.json as transformers saves them (data/train_tokenizer.py)."""
  return train_tokenizer.train_hf(texts, vocab_size, directory, config)


def test_a_hugging_face_tokenizer_round_trips_and_counts_its_bytes(tmp_path):
  config = tiny_config()
  config.data.paths = str(write_texts(tmp_path / 'corpus'))
  config.data.data_dir = str(tmp_path / 'tfds')
  config.data.tokenizer = 'hf'
  config.data.tokenizer_model = hf_byte_level_bpe(tmp_path / 'hf', list(TEXTS.values()))
  tok = tokenizers.load(config.data)
  assert 258 < tok.vocab_size <= 600  # the bytes, the two special tokens, and merges
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
  for text in TEXTS.values():
    ids = tok.encode(text.encode())
    assert tok.decode(ids) == text  # lossless, whitespace and Unicode included
    assert tok.token_bytes()[ids].sum() == len(text.encode())  # so bits per byte are right
  assert len(tok.encode(TEXTS['b.txt'].encode())) < len(TEXTS['b.txt']) / 2  # it compresses
  assert tok.token_bytes()[[tok.bos_id, tok.eos_id]].sum() == 0
  again = pickle.loads(pickle.dumps(tok))  # as grain's worker processes get it: by path
  text = TEXTS['a.py'].encode()
  np.testing.assert_array_equal(again.encode(text), tok.encode(text))
  assert_rows_decode_to_the_documents(config, tok)
  # Without its special tokens named, the documents could not be packed.
  hf_byte_level_bpe(tmp_path / 'bare', ['just text'], vocab_size=300, config=False)
  config.data.tokenizer_model = str(tmp_path / 'bare' / 'tokenizer.json')
  with pytest.raises(ValueError, match='does not name both bos_token and eos_token'):
    tokenizers.load(config.data)


def test_the_byte_tokenizer_in_hugging_face_form_is_the_same_tokenizer(tmp_path):
  tokenizers.ByteTokenizer().save_hf(tmp_path)  # what export.py writes for a byte-level run
  hf = tokenizers.HFTokenizer(str(tmp_path / 'tokenizer.json'))
  assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (259, 256, 257, 258)
  np.testing.assert_array_equal(hf.token_bytes(), BYTES.token_bytes())
  for text in [*TEXTS.values(), 'tabs\t, CRLF\r\n and bytes \x00\x7f']:
    ids = hf.encode(text.encode())
    np.testing.assert_array_equal(ids, BYTES.encode(text.encode()))
    assert hf.decode(ids) == text


def test_checkpoint_vocab_mismatch_is_a_clear_error():
  with pytest.raises(ValueError, match='config.data.tokenizer'):
    tokenizers.check_checkpoint_vocab(50304, BYTES, 384)


def test_undecodable_files_are_skipped_with_a_warning_and_blank_ones_silently(tmp_path):
  root = write_texts(tmp_path / 'corpus')
  (root / 'latin1.txt').write_bytes('caf\xe9'.encode('latin-1'))
  (root / 'blank.txt').write_text('  \n')
  config = tiny_config()
  config.data.paths, config.data.data_dir = str(root), str(tmp_path / 'tfds')
  with pytest.warns(corpus_lib.DataWarning, match='latin1.txt'):
    corpus = corpus_lib.load(config.data)
  paths = {corpus.train[i]['path'].decode() for i in range(len(corpus.train))} | {
      corpus.validation[i]['path'].decode() for i in range(len(corpus.validation))}
  assert paths == set(TEXTS)


def test_preparing_a_corpus_leaves_nothing_in_the_temporary_directory(tmp_path, monkeypatch):
  config = tiny_config()
  config.data.paths = str(write_texts(tmp_path / 'corpus'))
  config.data.data_dir = str(tmp_path / 'tfds')
  (tmp_path / 'tmp').mkdir()
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'tmp'))
  corpus_lib.check_source(config.data)
  corpus_lib.load(config.data)
  assert list((tmp_path / 'tmp').iterdir()) == []


def test_seq_len_longer_than_every_document_warns(tmp_path):
  config = tiny_config()
  config.data.paths = str(write_texts(tmp_path / 'corpus'))
  config.data.data_dir = str(tmp_path / 'tfds')
  corpus = corpus_lib.load(config.data)
  config.seq_len = 4096
  with pytest.warns(corpus_lib.DataWarning, match='config.seq_len'):
    corpus_lib.warn_about_length(corpus, config.seq_len, 0)


def bad(tmp_path):
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'binary').mkdir()
  (tmp_path / 'binary' / 'x.bin').write_bytes(bytes(range(128, 256)))
  (tmp_path / 'file').write_text('not a directory')
  return [
      (dict(paths=str(tmp_path / 'missing.txt')), 'config.data.paths'),
      (dict(paths=str(tmp_path / 'empty')), 'config.data.paths.*matches no files'),
      (dict(paths=''), 'config.data.paths is empty'),
      (dict(paths=str(tmp_path / 'binary')), 'config.data.paths: none of its'),
      (dict(data_dir=str(tmp_path / 'file' / 'tfds')), 'config.data.data_dir'),
      (dict(name='no_such_dataset_anywhere'), 'config.data.name'),
      (dict(name='lm1b'), "config.data.name='lm1b' is not prepared"),
      (dict(tokenizer='sentencepiece', tokenizer_model=str(tmp_path / 'none.model')),
       'config.data.tokenizer_model'),
      (dict(tokenizer='hf', tokenizer_model=str(tmp_path / 'tokenizer.json')),
       'config.data.tokenizer_model'),
      (dict(tokenizer='bpe'), 'config.data.tokenizer'),
      (dict(workers=3), 'config.data.workers'),
      (dict(tokenize='twice'), 'config.data.tokenize'),
      (dict(validation_fraction=1.5), 'config.data.validation_fraction'),
  ]


@pytest.mark.parametrize('index', range(13))
def test_bad_data_settings_fail_before_training_naming_the_setting(tmp_path, index):
  change, message = bad(tmp_path)[index]
  config = tiny_config(fsdp=8)
  config.workdir = str(tmp_path / 'run')
  config.data.data_dir = str(tmp_path / 'tfds')
  config.data.update(change)
  if 'paths' in change:  # a fresh corpus each time, never the prepared one
    config.data.validation_fraction = 0.5
  with pytest.raises(ValueError, match=message):
    loop.run(config)
  assert not (tmp_path / 'run' / 'metrics.jsonl').exists()
  # and before any data was prepared
  assert not [f for f in (tmp_path / 'tfds').rglob('*') if f.is_file()]


def test_vocab_smaller_than_the_tokenizer_is_an_error():
  with pytest.raises(ValueError, match='config.model.vocab_size=200 is smaller'):
    tokenizers.model_vocab_size(200, BYTES)


def test_a_failed_preparation_leaves_nothing_a_later_run_would_read(tmp_path, monkeypatch):
  config = tiny_config()
  config.data.paths = str(write_texts(tmp_path / 'corpus'))
  config.data.data_dir = str(tmp_path / 'tfds')
  real = corpus_lib.TextFiles._generate_examples

  def fail_midway(self, files):
    for i, example in enumerate(real(self, files)):
      if i == 1:
        raise OSError('disk full')
      yield example

  monkeypatch.setattr(corpus_lib.TextFiles, '_generate_examples', fail_midway)
  with pytest.raises(OSError, match='disk full'):
    corpus_lib.load(config.data)
  assert not corpus_lib.text_files_builder(config.data).is_prepared()
  leftovers = [p for p in (tmp_path / 'tfds').rglob('*') if p.is_file()]
  assert not leftovers, leftovers
  monkeypatch.undo()
  corpus = corpus_lib.load(config.data)  # a later run prepares it afresh
  assert len(corpus.train) + len(corpus.validation) == len(TEXTS)


def test_a_truncated_prepared_split_is_one_line_naming_it_and_how_to_prepare_it_again(tmp_path):
  """A copy cut short (a full disk, a half-synced data dir) fails when the corpus is opened, before
  anything is compiled, naming the directory; the file is left as it is."""
  config = tiny_config()
  config.data.paths = str(write_texts(tmp_path / 'corpus'))
  config.data.data_dir = str(tmp_path / 'tfds')
  corpus_lib.load(config.data)
  train_file, = (tmp_path / 'tfds').rglob('*-train.array_record*')
  with open(train_file, 'r+b') as f:
    f.truncate(1000)  # within the first record
  prepared = corpus_lib.text_files_builder(config.data).data_dir
  with pytest.raises(faults.Fault, match=rf'config.data: the prepared train split of text_files in '
                                          rf'{prepared} is damaged; prepare it again: move '
                                          rf'{prepared} away'):
    corpus_lib.load(config.data)
  assert train_file.stat().st_size == 1000


def test_repeated_documents_land_on_one_side_of_the_split():
  """corpus.split_documents: documents of one score (a record's hashes its content) go together;
  a corpus of one distinct document cannot be split."""
  scores = {('a', i): 0.01 for i in range(50)}  # one record, 50 times, under the fraction
  scores.update({('b', i): 0.5 + i / 100 for i in range(5)})
  train, validation = corpus_lib.split_documents(scores, 0.02)
  assert {k[0] for k in validation} == {'a'} and len(validation) == 50 and len(train) == 5
  scores = {('a', i): 0.9 for i in range(50)} | {('b', 0): 0.95}  # none under: the lowest group
  train, validation = corpus_lib.split_documents(scores, 0.02)
  assert len(validation) == 50 and train == [('b', 0)]
  with pytest.raises(ValueError, match='1 of them distinct'):
    corpus_lib.split_documents({('a', i): 0.3 for i in range(9)}, 0.02)


def test_a_corpus_hash_is_its_documents_not_their_order_or_files():
  digests = {k: bytes([i]) * 32 for i, k in enumerate('abcd')}
  same = corpus_lib.content_hash(digests, ['a', 'b'], ['c'])
  assert same == corpus_lib.content_hash(digests, ['b', 'a'], ['c'])
  assert same != corpus_lib.content_hash(digests, ['a', 'c'], ['b'])
  assert same != corpus_lib.content_hash({**digests, 'a': b'x' * 32}, ['a', 'b'], ['c'])


def test_a_run_keeps_its_tokenizer_and_refuses_one_replaced_at_its_path(tmp_path):
  """tokenizers.owned: the workdir's copy once it has one, wherever the original went; an
  original replaced at its path is refused, naming both fingerprints."""
  chat = pathlib.Path(__file__).parent / 'data' / 'hf-chat'
  source = tmp_path / 'tok'
  source.mkdir()
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (source / name).write_bytes((chat / 'chatml' / name).read_bytes())
  config = tiny_config()
  config.data.tokenizer, config.data.tokenizer_model = 'hf', str(source / 'tokenizer.json')
  run = tmp_path / 'run'
  run.mkdir()
  first = tokenizers.owned(config.data, str(run))
  fingerprint = first.fingerprint
  tokenizers.keep(first, run)
  (source / 'tokenizer.json').rename(source / 'moved.json')
  assert tokenizers.owned(config.data, str(run)).fingerprint == fingerprint
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (source / name).write_bytes((chat / 'llama3' / name).read_bytes())
  other = tokenizers.load(config.data).fingerprint
  with pytest.raises(ValueError, match=rf'is {other} now, but the run in .* trained with '
                                       rf'{fingerprint}'):
    tokenizers.owned(config.data, str(run))
  # The original intact, the run's copy replaced: the copy is named, by what its checkpoints hold.
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    (source / name).write_bytes((chat / 'chatml' / name).read_bytes())
    (run / tokenizers.KEPT / name).write_bytes((chat / 'llama3' / name).read_bytes())
  with pytest.raises(faults.Fault, match=rf'{run / tokenizers.KEPT}: the tokenizer is {other} '
                                         rf'now, but the run in .* trained with {fingerprint}'):
    tokenizers.owned(config.data, str(run), recorded=fingerprint)


def test_a_tokenizer_or_chat_corpus_is_never_written_over(tmp_path):
  from data import stdlib_chat
  existing = tmp_path / 'spm.model'
  existing.write_text('mine')
  with pytest.raises(ValueError, match='never written over another'):
    train_tokenizer.train(tiny_config().data, 300, str(tmp_path / 'spm'))
  assert existing.read_text() == 'mine'
  out = tmp_path / 'chat.jsonl'
  assert stdlib_chat.write(out, 5) == 5
  assert stdlib_chat.write(out, 5) == 5  # the same records: left as they are
  with pytest.raises(ValueError, match='holds other records'):
    stdlib_chat.write(out, 6)
  assert len(out.read_text().splitlines()) == 5 and len(list(tmp_path.iterdir())) == 2
