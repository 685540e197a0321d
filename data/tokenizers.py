"""Tokenizers: byte-level (the default; 256 bytes + BOS/EOS/PAD), SentencePiece, and Hugging Face's
`tokenizer.json` (the `tokenizers` library: Llama 3's, GPT-2's, any model's on the Hub).

A tokenizer turns a document's UTF-8 bytes into int32 ids and says how many bytes of text each id
stands for (`token_bytes`), which makes bits per byte comparable across tokenizers. Only numpy is
imported here (sentencepiece or tokenizers when used), so model-side code can read vocab sizes
cheaply.
"""

import hashlib
import json
import os
import pathlib
import shutil
import uuid

import numpy as np

from runtime import faults

VOCAB_MULTIPLE = 128  # the model's vocab is padded to this for fast matmuls


class ByteTokenizer:
  name = 'byte'
  vocab_size = 259
  bos_id, eos_id, pad_id = 256, 257, 258

  fingerprint = 'byte-1'

  def encode(self, text: bytes) -> np.ndarray:
    return np.frombuffer(text, np.uint8).astype(np.int32)

  def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')

  def token_bytes(self) -> np.ndarray:
    return (np.arange(self.vocab_size) < 256).astype(np.float32)

  def save_hf(self, directory: pathlib.Path) -> None:
    """This tokenizer as a Hugging Face tokenizer.json (and tokenizer_config.json): a byte-level
    BPE with no merges, each byte its own id, then <s>, </s> and <pad> as BOS, EOS and PAD."""
    import tokenizers  # only needed when exporting
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=dict(_BYTE_OF_CHAR), merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(['<s>', '</s>', '<pad>'])  # ids 256, 257, 258
    tok.save(str(directory / 'tokenizer.json'))
    (directory / 'tokenizer_config.json').write_text(json.dumps(
        {'bos_token': '<s>', 'eos_token': '</s>', 'pad_token': '<pad>',
         'tokenizer_class': 'PreTrainedTokenizerFast'}, indent=2) + '\n')


class _FromFile:
  """A tokenizer loaded from a file. It pickles by path, so grain's worker processes load their
  own copy."""

  files = ()  # beside `path`, read with it: they change what the tokenizer does

  def __init__(self, path: str):
    self.path = str(path)
    self._load()
    self.fingerprint = self._fingerprint()

  def _load(self):
    raise NotImplementedError

  def _fingerprint(self) -> str:
    """A hash of the model file and the files beside it that it reads, as loaded: prepared token
    ids (data/tokens.py) are kept under it, so another tokenizer never reads them."""
    h = hashlib.sha256(self.name.encode())
    for path in (pathlib.Path(self.path), *(pathlib.Path(self.path).with_name(f)
                                            for f in self.files)):
      h.update(path.name.encode() + b'\0' + (path.read_bytes() if path.is_file() else b'-'))
    return f'{self.name}-{h.hexdigest()[:12]}'

  def __getstate__(self):
    return {'path': self.path}

  def __setstate__(self, state):
    self.__init__(state['path'])


class SentencePieceTokenizer(_FromFile):
  """A trained SentencePiece model (python -m data.train_tokenizer makes one)."""
  name = 'sentencepiece'

  def _load(self):
    import sentencepiece  # only needed when this tokenizer is configured
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
    except (OSError, RuntimeError) as e:
      raise ValueError(f'config.data.tokenizer_model={self.path!r} is not a SentencePiece '
                       f'model ({e}); train one with python -m data.train_tokenizer') from None
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id, self.eos_id, self.pad_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
    if min(self.bos_id, self.eos_id, self.pad_id) < 0:
      raise ValueError(f'config.data.tokenizer_model={self.path!r} lacks a BOS, EOS or PAD '
                       'piece; train it with bos_id, eos_id and pad_id set (data.train_tokenizer '
                       'does)')

  def encode(self, text: bytes) -> np.ndarray:
    return np.asarray(self._sp.encode(text.decode('utf-8')), np.int32)

  def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
    """On SentencePiece's threads, one per CPU."""
    ids = self._sp.encode([t.decode('utf-8') for t in texts], num_threads=os.cpu_count() or 1)
    return [np.asarray(i, np.int32) for i in ids]

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

  def token_bytes(self) -> np.ndarray:
    sp, counts = self._sp, np.zeros(self.vocab_size, np.float32)
    for i in range(self.vocab_size):
      if sp.is_control(i) or sp.is_unknown(i):
        continue
      piece = sp.id_to_piece(i)
      counts[i] = 1 if sp.is_byte(i) else len(piece.replace('\u2581', ' ').encode('utf-8'))
    return counts


class HFTokenizer(_FromFile):
  """A Hugging Face `tokenizer.json`, with BOS and EOS (and PAD, else EOS) named by the
  `tokenizer_config.json` beside it, as transformers reads them, and the chat template there (or
  in the `chat_template.jinja` beside it)."""
  name = 'hf'
  files = ('tokenizer_config.json', 'chat_template.jinja', 'special_tokens_map.json')
  SPECIAL = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token',
             'mask_token')  # the named special tokens a chat template sees, as transformers'

  def _load(self):
    import tokenizers  # only needed when this tokenizer is configured
    setting = f'config.data.tokenizer_model={self.path!r}'
    try:
      self._tok = tokenizers.Tokenizer.from_file(self.path)
    except Exception as e:  # the library raises a bare Exception for a malformed file
      raise ValueError(f'{setting} is not a Hugging Face tokenizer.json ({e})') from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    special = pathlib.Path(self.path).with_name('tokenizer_config.json')
    names = json.loads(special.read_text()) if special.is_file() else {}
    legacy = pathlib.Path(self.path).with_name('special_tokens_map.json')
    names = {**(json.loads(legacy.read_text()) if legacy.is_file() else {}), **names}
    self.special_tokens = {}
    for key in self.SPECIAL:
      token = names.get(key)
      token = token.get('content') if isinstance(token, dict) else token
      if isinstance(token, str):
        self.special_tokens[key] = token
    self.chat_template = _chat_template(names.get('chat_template'),
                                        pathlib.Path(self.path).with_name('chat_template.jinja'))
    ids = {}
    for role in ('bos', 'eos', 'pad'):
      token = self.special_tokens.get(f'{role}_token')
      ids[role] = None if token is None else self._tok.token_to_id(token)
      if token is not None and ids[role] is None:
        raise ValueError(f'{setting}: its {special.name} names {role}_token {token!r}, which '
                         'the tokenizer does not have')
    if ids['bos'] is None or ids['eos'] is None:
      raise ValueError(f'{setting}: every document is packed as BOS … EOS, and {special} does '
                       'not name both bos_token and eos_token')
    self.bos_id, self.eos_id = ids['bos'], ids['eos']
    self.pad_id = self.eos_id if ids['pad'] is None else ids['pad']  # pads carry no weight

  def encode(self, text: bytes) -> np.ndarray:
    return np.asarray(self._tok.encode(text.decode('utf-8'), add_special_tokens=False).ids,
                      np.int32)

  def encode_batch(self, texts: list[bytes]) -> list[np.ndarray]:
    """On the library's own threads (RAYON_NUM_THREADS, else one per CPU)."""
    encodings = self._tok.encode_batch_fast([t.decode('utf-8') for t in texts],
                                            add_special_tokens=False)
    return [np.asarray(e.ids, np.int32) for e in encodings]

  def encode_offsets_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, the character each starts at) of each text."""
    encodings = self._tok.encode_batch(texts, add_special_tokens=False)
    return [(np.asarray(e.ids, np.int32), np.asarray([a for a, _ in e.offsets], np.int64))
            for e in encodings]

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids if 0 <= i < self.vocab_size],
                            skip_special_tokens=True)

  def save_hf(self, directory: pathlib.Path) -> None:
    """Copies tokenizer.json and the files beside it that it reads."""
    for name in ('tokenizer.json', *self.files):
      if (source := pathlib.Path(self.path).with_name(name)).is_file():
        shutil.copyfile(source, directory / name)

  def token_bytes(self) -> np.ndarray:
    """Bytes of text per id: byte-level BPE maps each byte to a printable character (GPT-2's
    table, inverted here); SentencePiece-style models write a space as ▁ and a fallback byte as
    <0xNN>. Special tokens stand for no text."""
    counts = np.zeros(self.vocab_size, np.float32)
    special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
    byte_level = 'ByteLevel' in json.dumps(json.loads(self._tok.to_str()).get('decoder'))
    for piece, i in self._tok.get_vocab(with_added_tokens=True).items():
      if piece in special:
        continue
      if byte_level and all(c in _BYTE_OF_CHAR for c in piece):
        counts[i] = len(piece)
      elif len(piece) == 6 and piece.startswith('<0x') and piece.endswith('>'):
        counts[i] = 1
      else:
        counts[i] = len(piece.replace('\u2581', ' ').encode('utf-8'))
    return counts


def _chat_template(configured, beside: pathlib.Path) -> str | None:
  """The template transformers uses: tokenizer_config.json's (a string, or a list of named ones
  of which 'default'), else the chat_template.jinja file."""
  if isinstance(configured, list):
    configured = next((t.get('template') for t in configured if isinstance(t, dict)
                       and t.get('name') == 'default'), None)
  if isinstance(configured, str) and configured:
    return configured
  return beside.read_text() if beside.is_file() else None


def _gpt2_byte_table() -> dict[str, int]:
  """GPT-2's byte-level alphabet: each byte is a printable character (the printable Latin-1 ones
  stand for themselves, the rest are moved up past 255), so a token is a string of bytes."""
  kept = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
          *range(ord('®'), ord('ÿ') + 1)]
  moved = [b for b in range(256) if b not in kept]
  return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(moved)}}


_BYTE_OF_CHAR = _gpt2_byte_table()

Tokenizer = ByteTokenizer | SentencePieceTokenizer | HFTokenizer


# What config.data.tokenizer_model must be, for the tokenizers that read one.
_MODEL_FILES = {
    'sentencepiece': (SentencePieceTokenizer, 'train a SentencePiece model with python -m '
                      'data.train_tokenizer --config=... --vocab_size=N --output=PREFIX and pass '
                      'PREFIX.model'),
    'hf': (HFTokenizer, "with config.data.tokenizer='hf' it is a model's tokenizer.json, with "
           'its tokenizer_config.json beside it'),
}


def load(data_config) -> Tokenizer:
  """The tokenizer `config.data` names; a missing or broken model file is a clear error."""
  return named(data_config.tokenizer, data_config.tokenizer_model)


def named(kind: str, model: str) -> Tokenizer:
  """The tokenizer of config.data.tokenizer=`kind` and tokenizer_model=`model`."""
  if kind == 'byte':
    return ByteTokenizer()
  if kind not in _MODEL_FILES:
    raise ValueError(f"config.data.tokenizer={kind!r} is not 'byte', 'sentencepiece' or 'hf'")
  make, what = _MODEL_FILES[kind]
  model_file = pathlib.Path(model).expanduser()
  if not model or not model_file.is_file():
    raise ValueError(f'config.data.tokenizer_model={model!r} is not a file; {what}')
  return make(str(model_file))


KEPT = 'tokenizer'  # a run's copy of its tokenizer's files, in its workdir


def kept_model(workdir: pathlib.Path, kind: str, model: str) -> str | None:
  """The run's own copy of its tokenizer_model `model` (of config.data.tokenizer=`kind`) in its
  workdir, if it has one."""
  if kind == 'byte' or not model:
    return None
  copy = pathlib.Path(workdir).expanduser() / KEPT / pathlib.Path(model).name
  return str(copy) if copy.is_file() else None


def owned(data_config, workdir, recorded: str = '') -> Tokenizer:
  """The tokenizer a run in `workdir` trains with: its own copy (workdir/tokenizer/, written by
  `keep` when it started) once it has one, wherever the original went; else config.data's. A
  copy that is not what the run's checkpoints `recorded` it trained with (a fingerprint) was
  changed, and is refused, naming it; an original that is there but no longer the run's
  (replaced, retrained over) is refused, naming both fingerprints: the run's embeddings are its
  own tokenizer's ids."""
  kept = (kept_model(workdir, data_config.tokenizer, data_config.tokenizer_model) if workdir
          else None)
  if kept is None:
    return load(data_config)
  mine = _MODEL_FILES[data_config.tokenizer][0](kept)
  if recorded and mine.fingerprint != recorded:
    raise faults.Fault(f'{pathlib.Path(kept).parent}: the tokenizer is {mine.fingerprint} now, '
                       f'but the run in {workdir} trained with {recorded}: the run\'s own copy '
                       'was changed. Put back the files the run trained with')
  source = pathlib.Path(data_config.tokenizer_model).expanduser()
  if source.is_file() and source.resolve() != pathlib.Path(kept).resolve():
    theirs = load(data_config)
    if theirs.fingerprint != mine.fingerprint:
      raise ValueError(
          f'config.data.tokenizer_model={str(source)!r} is {theirs.fingerprint} now, but the run '
          f'in {workdir} trained with {mine.fingerprint}, kept in {pathlib.Path(kept).parent}: '
          'it keeps its own. Put the original back, or train the new tokenizer in another '
          '--config.workdir')
  return mine


def keep(tokenizer: Tokenizer, workdir: pathlib.Path) -> None:
  """Copies the tokenizer's files into workdir/tokenizer/ once (into a partial directory renamed
  when whole), so a resumed run, sample.py and export.py read the run's own (`owned`)."""
  if not isinstance(tokenizer, _FromFile):
    return
  kept = workdir / KEPT
  if kept.is_dir():
    return
  partial = workdir / f'{KEPT}.partial-{uuid.uuid4().hex[:8]}'
  partial.mkdir()
  try:
    for source in (pathlib.Path(tokenizer.path),
                   *(pathlib.Path(tokenizer.path).with_name(f) for f in tokenizer.files)):
      if source.is_file():
        shutil.copyfile(source, partial / source.name)
    partial.rename(kept)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise


def padded_vocab_size(n: int) -> int:
  return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_vocab_size(vocab_size: int, tokenizer: Tokenizer, init_from: str = '') -> int:
  """config.model.vocab_size for this tokenizer: 0 (the default) becomes the tokenizer's size
  padded to a multiple of 128; an explicit size must hold every token."""
  if vocab_size == 0:
    return padded_vocab_size(tokenizer.vocab_size)
  if vocab_size < tokenizer.vocab_size and init_from not in ('', 'random'):
    raise ValueError(f'config.init_from={init_from}: its model has a vocabulary of '
                     f'{vocab_size}, fewer than the {tokenizer.vocab_size} tokens '
                     f'of the {tokenizer.name} tokenizer config.data names; use the tokenizer '
                     'it was trained with (leave config.data.tokenizer at its default to take '
                     'its own)')
  if vocab_size < tokenizer.vocab_size:
    raise ValueError(f'config.model.vocab_size={vocab_size} is smaller than the '
                     f'{tokenizer.name} tokenizer\'s {tokenizer.vocab_size} tokens; set it to 0 '
                     'to follow the tokenizer')
  return vocab_size


def check_checkpoint_vocab(saved_vocab_size: int, tokenizer: Tokenizer, vocab_size: int) -> None:
  """A checkpoint's embedding must match the model this tokenizer implies."""
  if saved_vocab_size != vocab_size:
    raise ValueError(
        f'the checkpoint has a vocabulary of {saved_vocab_size} but the configured '
        f'{tokenizer.name} tokenizer ({tokenizer.vocab_size} tokens) gives the model {vocab_size};'
        ' use the tokenizer the checkpoint was trained with (config.data.tokenizer, '
        'config.data.tokenizer_model) or set config.model.vocab_size')
