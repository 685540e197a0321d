"""Byte-level packed batches over a local text corpus (default: the Python standard library's .py
files, which every machine with Python has). The data-pipeline issue replaces this with TFDS+grain.

Each file is a document `BOS bytes EOS`; documents are concatenated into one stream. A batch row is
a random window of seq_len+1 tokens, so it packs pieces of several documents: segment ids number
the documents within the row (from 1) and positions restart at each document's start, so the model
never attends across documents and no target crosses a document boundary.
"""

import pathlib
import sysconfig

import jax
import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 259  # the model's vocab_size may be larger (padded for fast matmuls)


def stdlib_files() -> list[pathlib.Path]:
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = sorted(p for p in root.rglob('*.py') if 'site-packages' not in p.parts and p.is_file())
  if not files:
    raise FileNotFoundError(f'config.data.corpus=stdlib: no .py files under {root}')
  return files


def split_files(files, eval_every_nth: int):
  """Deterministic split: every `eval_every_nth` file (in sorted order) is held out."""
  if eval_every_nth < 2:
    raise ValueError(f'config.data.eval_every_nth_file={eval_every_nth} must be at least 2')
  train = [f for i, f in enumerate(files) if i % eval_every_nth]
  held_out = [f for i, f in enumerate(files) if i % eval_every_nth == 0]
  return train, held_out


class ByteCorpus:
  """Documents as one token stream with, per token, its document index and position in it."""

  def __init__(self, documents: list[bytes]):
    documents = [d for d in documents if d]
    if not documents:
      raise ValueError('the corpus holds no text')
    lengths = np.array([len(d) + 2 for d in documents], np.int64)  # + BOS, EOS
    self.tokens = np.empty(lengths.sum(), np.uint16)
    self.doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for start, doc in zip(self.doc_starts, documents):
      self.tokens[start] = BOS
      self.tokens[start + 1:start + 1 + len(doc)] = np.frombuffer(doc, np.uint8)
      self.tokens[start + 1 + len(doc)] = EOS
    self.doc_ids = np.repeat(np.arange(len(documents), dtype=np.int32), lengths)

  @classmethod
  def from_files(cls, paths) -> 'ByteCorpus':
    return cls([pathlib.Path(p).read_bytes() for p in paths])

  def __len__(self):
    return len(self.tokens)

  def windows(self, offsets, seq_len: int) -> dict[str, np.ndarray]:
    """Rows starting at `offsets`: inputs, targets, positions, segment_ids ([B, L] int32) and
    weights ([B, L] float32, 0 where the target belongs to another document)."""
    idx = np.asarray(offsets)[:, None] + np.arange(seq_len + 1)
    tokens, docs = self.tokens[idx].astype(np.int32), self.doc_ids[idx]
    segments = docs - docs[:, :1] + 1
    positions = (idx - self.doc_starts[docs]).astype(np.int32)
    return {
        'inputs': tokens[:, :-1],
        'targets': tokens[:, 1:],
        'positions': positions[:, :-1],
        'segment_ids': segments[:, :-1].astype(np.int32),
        'weights': (segments[:, :-1] == segments[:, 1:]).astype(np.float32),
    }


class Batches:
  """Global batch number `step` depends only on (seed, step); each process builds only its own
  rows and the global batch is assembled as one sharded jax.Array."""

  def __init__(self, corpus: ByteCorpus, *, batch_size: int, seq_len: int, seed: int, sharding):
    if len(corpus) <= seq_len + 1:
      raise ValueError(f'config.seq_len={seq_len} is longer than the whole corpus '
                       f'({len(corpus)} tokens)')
    n_proc, proc = jax.process_count(), jax.process_index()
    if batch_size % n_proc:
      raise ValueError(f'config.batch_size={batch_size} must divide by the {n_proc} processes')
    self.corpus, self.seq_len, self.seed, self.sharding = corpus, seq_len, seed, sharding
    self.batch_size = batch_size
    self.rows = slice(proc * batch_size // n_proc, (proc + 1) * batch_size // n_proc)

  def offsets(self, step: int) -> np.ndarray:
    rng = np.random.default_rng((self.seed, step))
    return rng.integers(0, len(self.corpus) - self.seq_len - 1, size=self.batch_size)

  def local(self, step: int) -> dict[str, np.ndarray]:
    return self.corpus.windows(self.offsets(step)[self.rows], self.seq_len)

  def __call__(self, step: int) -> dict[str, jax.Array]:
    return {k: jax.make_array_from_process_local_data(self.sharding, v)
            for k, v in self.local(step).items()}
