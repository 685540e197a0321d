"""Tokenizers: byte-level (the default; 256 bytes + BOS/EOS/PAD) and SentencePiece.

A tokenizer turns a document's UTF-8 bytes into int32 ids and says how many bytes of text each id
stands for (`token_bytes`), which makes bits per byte comparable across tokenizers. Only numpy is
imported here (sentencepiece when used), so model-side code can read vocab sizes cheaply.
"""

import pathlib

import numpy as np

VOCAB_MULTIPLE = 128  # the model's vocab is padded to this for fast matmuls


class ByteTokenizer:
  name = 'byte'
  vocab_size = 259
  bos_id, eos_id, pad_id = 256, 257, 258

  def encode(self, text: bytes) -> np.ndarray:
    return np.frombuffer(text, np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')

  def token_bytes(self) -> np.ndarray:
    return (np.arange(self.vocab_size) < 256).astype(np.float32)


class SentencePieceTokenizer:
  """A trained SentencePiece model (python -m data.train_tokenizer makes one). Pickles by path,
  so grain's worker processes load their own copy."""
  name = 'sentencepiece'

  def __init__(self, model_file: str):
    self.model_file = str(model_file)
    self._load()

  def _load(self):
    import sentencepiece  # only needed when this tokenizer is configured
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model_file)
    except (OSError, RuntimeError) as e:
      raise ValueError(f'config.data.tokenizer_model={self.model_file!r} is not a SentencePiece '
                       f'model ({e}); train one with python -m data.train_tokenizer') from None
    self.vocab_size = self._sp.get_piece_size()
    self.bos_id, self.eos_id, self.pad_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
    if min(self.bos_id, self.eos_id, self.pad_id) < 0:
      raise ValueError(f'config.data.tokenizer_model={self.model_file!r} lacks a BOS, EOS or PAD '
                       'piece; train it with bos_id, eos_id and pad_id set (data.train_tokenizer '
                       'does)')

  def __getstate__(self):
    return {'model_file': self.model_file}

  def __setstate__(self, state):
    self.model_file = state['model_file']
    self._load()

  def encode(self, text: bytes) -> np.ndarray:
    return np.asarray(self._sp.encode(text.decode('utf-8')), np.int32)

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


Tokenizer = ByteTokenizer | SentencePieceTokenizer


def load(data_config) -> Tokenizer:
  """The tokenizer `config.data` names; a missing or broken model file is a clear error."""
  if data_config.tokenizer == 'byte':
    return ByteTokenizer()
  if data_config.tokenizer == 'sentencepiece':
    model_file = pathlib.Path(data_config.tokenizer_model).expanduser()
    if not data_config.tokenizer_model or not model_file.is_file():
      raise ValueError(f'config.data.tokenizer_model={data_config.tokenizer_model!r} is not a file;'
                       ' train a SentencePiece model with python -m data.train_tokenizer '
                       '--config=... --vocab_size=N --output=PREFIX and pass PREFIX.model')
    return SentencePieceTokenizer(str(model_file))
  raise ValueError(f"config.data.tokenizer={data_config.tokenizer!r} is not 'byte' or "
                   "'sentencepiece'")


def padded_vocab_size(n: int) -> int:
  return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def with_vocab_size(config, tokenizer: Tokenizer):
  """A copy of `config` whose model.vocab_size follows the tokenizer: 0 (the default) becomes the
  tokenizer's size padded to a multiple of 128; an explicit size must hold every token."""
  config = config.copy_and_resolve_references()  # the caller's config stays as given
  if config.model.vocab_size == 0:
    config.model.vocab_size = padded_vocab_size(tokenizer.vocab_size)
  elif config.model.vocab_size < tokenizer.vocab_size:
    raise ValueError(f'config.model.vocab_size={config.model.vocab_size} is smaller than the '
                     f'{tokenizer.name} tokenizer\'s {tokenizer.vocab_size} tokens; set it to 0 '
                     'to follow the tokenizer')
  return config


def check_checkpoint_vocab(saved_vocab_size: int, tokenizer: Tokenizer, vocab_size: int) -> None:
  """A checkpoint's embedding must match the model this tokenizer implies."""
  if saved_vocab_size != vocab_size:
    raise ValueError(
        f'the checkpoint has a vocabulary of {saved_vocab_size} but the configured '
        f'{tokenizer.name} tokenizer ({tokenizer.vocab_size} tokens) gives the model {vocab_size};'
        ' use the tokenizer the checkpoint was trained with (config.data.tokenizer, '
        'config.data.tokenizer_model) or set config.model.vocab_size')
