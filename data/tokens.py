"""Documents as token ids, `BOS ids… EOS` in int32, by index: tokenized once and stored, or
tokenized as packing asks for them. Both give the same arrays, so the batches are the same. A
prompt-and-completion or chat corpus's documents carry the weight of predicting each token too
(data/chat.py: a `[2, n]` array).

- **Once** (`config.data.tokenize='once'`): preparation encodes every document of both splits, a
  batch at a time on the tokenizer's own threads (`encode_batch`), and writes its ids to an
  array_record file per split (uint16 where the vocabulary fits, int32 otherwise) in
  `{data_dir}/meshlm_tokens/{dataset}-{tokenizer fingerprint}-{key}/`. The fingerprint hashes the
  tokenizer's files and the key the prepared corpus's (names, sizes, modification times) and, for
  records, the chat template and what is trained on, so another tokenizer, template or an edited
  corpus is prepared afresh, never confused with these. A weighted document's record is its ids
  then a byte per id of weights. It is
  written into an `incomplete-*` directory and renamed when whole; a failure removes it, and a
  killed preparation leaves only that directory, which no run reads. Training then reads integers.
- **On the fly** (`'on_the_fly'`): the text is read and encoded when packing asks, a batch of a
  lane's next documents at a time (data/pipeline.py).
- `'auto'` (the default): once, but for the byte tokenizer, whose ids are the text's own bytes.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import uuid

import numpy as np

from data import records
from data.chat import Encoder
from runtime import faults
from runtime.workdir import writable_dir

BATCH = 256  # documents encoded at once while preparing


def check_settings(data_config) -> None:
  """What the data settings' declarations (configs/base.py) do not judge: what crosses them (the
  chat template's are chat.owned's, which reads it)."""
  records.check_kind(data_config)


def encoder(corpus, tokenizer, data_config, template=None) -> Encoder:
  """How the corpus's stored documents become token arrays (chat records rendered with
  `template`, the run's: chat.owned)."""
  return Encoder(tokenizer, corpus.record, template, data_config.train_on)


@dataclasses.dataclass
class Documents:
  """The splits as sources of token arrays (`len`, and `get(indices)` → a list of arrays)."""
  train: object
  validation: object
  description: str  # how they are read


class OnTheFly:
  """A text source's documents, encoded when asked for."""

  def __init__(self, source, text_key: str, encode: Encoder):
    self.source, self.text_key, self.encode = source, text_key, encode

  def __len__(self):
    return len(self.source)

  def get(self, indices) -> list[np.ndarray]:
    return self.encode([self.source[int(i)][self.text_key] for i in indices])


class Prepared:
  """A split's stored token ids. It pickles by path: grain's worker processes open their own."""

  def __init__(self, path: str, dtype: str, damaged: str, weighted: bool = False):
    self.path, self.dtype, self.damaged, self.weighted = path, dtype, damaged, weighted
    self._reader = None

  def _read(self, read):
    try:
      if self._reader is None:
        import grain
        self._reader = grain.sources.ArrayRecordDataSource(self.path)
      return read(self._reader)
    except Exception as e:  # array_record's own errors: a truncated or corrupted file
      reason = (str(e).splitlines() or [type(e).__name__])[0][:160]
      raise faults.Fault(f'{self.damaged} ({reason})') from None

  def __len__(self):
    return self._read(len)

  def get(self, indices) -> list[np.ndarray]:
    records = self._read(lambda reader: reader.__getitems__([int(i) for i in indices]))
    return [_document(r, self.dtype, self.weighted) for r in records]

  def __getstate__(self):
    return {**self.__dict__, '_reader': None}


def _record(document: np.ndarray, dtype) -> bytes:
  if document.ndim == 1:
    return document.astype(dtype).tobytes()
  return document[0].astype(dtype).tobytes() + document[1].astype(np.uint8).tobytes()


def _document(record: bytes, dtype: str, weighted: bool) -> np.ndarray:
  if not weighted:
    return np.frombuffer(record, dtype).astype(np.int32)
  n = len(record) // (np.dtype(dtype).itemsize + 1)
  ids = np.frombuffer(record, dtype, count=n).astype(np.int32)
  return np.stack([ids, np.frombuffer(record, np.uint8, offset=ids.size * np.dtype(dtype).itemsize
                                      ).astype(np.int32)])


def _corpus_key(corpus, encode: Encoder) -> str:
  """A hash of the prepared corpus's files, what is read of them and how it is encoded."""
  h = hashlib.sha256(f'{corpus.text_key}\0{corpus.splits}\0{corpus.prepared_in}\n'.encode())
  if encode.key:
    h.update(f'{encode.key}\n'.encode())
  for f in sorted(pathlib.Path(corpus.prepared_in).iterdir()):
    if f.is_file():
      st = f.stat()
      h.update(f'{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n'.encode())
  return h.hexdigest()[:12]


def _write(source, text_key: str, encode: Encoder, path: pathlib.Path, dtype) -> int:
  from array_record.python.array_record_module import ArrayRecordWriter
  writer, tokens = ArrayRecordWriter(str(path), 'group_size:1'), 0
  try:
    for start in range(0, len(source), BATCH):
      texts = [source[i][text_key] for i in range(start, min(start + BATCH, len(source)))]
      for document in encode(texts):
        writer.write(_record(document, dtype))
        tokens += document.shape[-1]
    writer.close()
  except RuntimeError as e:  # array_record's own way of saying a write failed (a full disk)
    raise faults.Fault(f'config.data.data_dir: writing token ids to {path.parent} failed '
                       f'({str(e).splitlines()[0][:160]}); free space there, or set '
                       "config.data.tokenize='on_the_fly'") from None
  return tokens


def prepared_dir(corpus, encode: Encoder, data_dir: str) -> pathlib.Path:
  key = _corpus_key(corpus, encode)
  fingerprint = encode.tokenizer.fingerprint
  return pathlib.Path(data_dir) / 'meshlm_tokens' / f'{corpus.name}-{fingerprint}-{key}'


def prepare(corpus, encode: Encoder, data_dir: str) -> pathlib.Path:
  """The directory of the corpus's token ids as `encode` makes them, written first if it is not
  there."""
  tokenizer = encode.tokenizer
  final = prepared_dir(corpus, encode, data_dir)
  if (final / 'info.json').is_file():
    return final
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
  writable_dir(data_dir, 'config.data.data_dir')  # or config.data.tokenize='on_the_fly'
  partial = final.with_name(f'incomplete-{final.name}-{uuid.uuid4().hex[:8]}')
  partial.mkdir(parents=True)
  try:
    info = {'tokenizer': tokenizer.fingerprint, 'corpus': corpus.description,
            'dtype': np.dtype(dtype).name, 'weighted': encode.masked, 'documents': {},
            'tokens': {}}
    for split, source in zip(corpus.splits, (corpus.train, corpus.validation)):
      info['tokens'][split] = _write(source, corpus.text_key, encode,
                                     partial / f'{split}.array_record', dtype)
      info['documents'][split] = len(source)
    (partial / 'info.json').write_text(json.dumps(info, indent=2) + '\n')
    os.rename(partial, final)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    if (final / 'info.json').is_file():  # another process prepared them meanwhile
      return final
    raise
  return final


def load(corpus, tokenizer, data_config, data_dir: str | None = None, template=None) -> Documents:
  """The corpus's documents as config.data.tokenize says, preparing their ids if needed in
  `data_dir` (default the corpus's: config.data.data_dir; chat records rendered with `template`,
  the run's: chat.owned)."""
  check_settings(data_config)
  encode = encoder(corpus, tokenizer, data_config, template)
  if data_config.tokenize == 'on_the_fly' or (data_config.tokenize == 'auto'
                                              and tokenizer.name == 'byte'):
    return Documents(OnTheFly(corpus.train, corpus.text_key, encode),
                     OnTheFly(corpus.validation, corpus.text_key, encode),
                     'tokenized on the fly')
  directory = prepare(corpus, encode, data_dir or corpus.data_dir)
  info = json.loads((directory / 'info.json').read_text())
  sources = [Prepared(str(directory / f'{split}.array_record'), info['dtype'],
                      f'config.data: the prepared token ids in {directory} are damaged; delete '
                      'that directory and the next run prepares them again',
                      info.get('weighted', False))
             for split in corpus.splits]
  for source, split in zip(sources, corpus.splits):
    if len(source) != info['documents'][split]:
      raise faults.Fault(f'{source.damaged} ({split}: {len(source)} documents of '
                         f'{info["documents"][split]})')
    source.get([len(source) - 1])  # a truncated file fails at its end: before any compile
  return Documents(*sources, f'token ids prepared in {directory} '
                   f'({sum(info["tokens"].values()):,} tokens)')
