"""Train a tokenizer on the configured corpus's training split: SentencePiece, or a Hugging Face
byte-level BPE (as GPT-2's and Llama 3's are).

  python -m data.train_tokenizer --config=configs/default.py --vocab_size=4096 \
      --output=/tmp/meshlm-spm/stdlib4k
  python train.py --config=configs/default.py --config.data.tokenizer=sentencepiece \
      --config.data.tokenizer_model=/tmp/meshlm-spm/stdlib4k.model
  python -m data.train_tokenizer --config=configs/default.py --kind=hf --vocab_size=32000 \
      --output=/tmp/meshlm-bpe32k
  python train.py --config=configs/default.py --config.data.tokenizer=hf \
      --config.data.tokenizer_model=/tmp/meshlm-bpe32k/tokenizer.json

The SentencePiece model is lossless on any text (identity normalisation, whitespace kept as is,
unknown characters fall back to bytes), and has BOS=1, EOS=2, PAD=3, UNK=0. Training reads lines
of the training split's documents (at most --max_lines, sampled by SentencePiece); newlines
themselves are byte tokens. The byte-level BPE is lossless by construction; it trains on whole
documents, and its tokenizer_config.json names Llama 3's BOS and EOS tokens (ids 0 and 1).
"""

import json
import pathlib

from absl import app, flags

HF_SPECIAL = ('<|begin_of_text|>', '<|end_of_text|>')  # BOS, EOS (also PAD), as Llama 3's


def train(data_config, vocab_size: int, output: str, model_type: str = 'bpe',
          max_lines: int = 2_000_000) -> str:
  """Train on config.data's training split; returns the path of the .model file."""
  import sentencepiece

  from data import corpus as corpus_lib
  from runtime.workdir import writable_dir
  if vocab_size < 260:
    raise ValueError(f'--vocab_size={vocab_size} must be at least 260 (4 specials and 256 byte '
                     'pieces)')
  prefix = pathlib.Path(output).expanduser()
  _refuse_existing([prefix.with_name(f'{prefix.name}.model'),
                    prefix.with_name(f'{prefix.name}.vocab')])
  writable_dir(str(prefix.parent), '--output (its folder)')
  source = corpus_lib.load(data_config)

  def lines():
    for i in range(len(source.train)):
      text = source.train[i][source.text_key].decode('utf-8')
      yield from (line for line in text.split('\n') if line.strip())

  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=lines(), model_prefix=str(pathlib.Path(output).expanduser()),
      vocab_size=vocab_size, model_type=model_type, byte_fallback=True,
      normalization_rule_name='identity', remove_extra_whitespaces=False, add_dummy_prefix=False,
      allow_whitespace_only_pieces=True, split_digits=True, character_coverage=0.9999,
      unk_id=0, bos_id=1, eos_id=2, pad_id=3, input_sentence_size=max_lines,
      shuffle_input_sentence=True, max_sentence_length=1 << 16, minloglevel=2,
      num_threads=4)
  return str(pathlib.Path(output).expanduser()) + '.model'


def _refuse_existing(files) -> None:
  """ValueError naming the first of `files` that exists: a tokenizer is never trained over
  another, which a run (its embeddings, its prepared ids) may be using."""
  for file in files:
    if file.exists():
      raise ValueError(f'--output: {file} exists, and a tokenizer is never written over another '
                       '(a run trained on its ids keeps them); give a new --output')


def train_hf(texts, vocab_size: int, directory, special: bool = True) -> str:
  """A byte-level BPE of `vocab_size` ids trained on `texts` (strings), saved as `directory`'s
  tokenizer.json and (with `special`) the tokenizer_config.json naming its BOS and EOS, as
  transformers saves them; returns the tokenizer.json's path."""
  import tokenizers as hf
  tok = hf.Tokenizer(hf.models.BPE())
  tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf.decoders.ByteLevel()
  tok.train_from_iterator(texts, hf.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(HF_SPECIAL), show_progress=False,
      initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
  directory = pathlib.Path(directory).expanduser()
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / 'tokenizer.json'))
  if special:
    (directory / 'tokenizer_config.json').write_text(json.dumps(
        {'bos_token': HF_SPECIAL[0], 'eos_token': {'content': HF_SPECIAL[1], 'special': True}}))
  return str(directory / 'tokenizer.json')


def train_hf_on_corpus(data_config, vocab_size: int, output: str) -> str:
  """train_hf on config.data's training split, into the directory `output`."""
  from data import corpus as corpus_lib
  from runtime.workdir import writable_dir
  if vocab_size < 259:
    raise ValueError(f'--vocab_size={vocab_size} must be at least 259 (256 bytes and 3 '
                     'special tokens)')
  directory = pathlib.Path(output).expanduser()
  _refuse_existing([directory / 'tokenizer.json', directory / 'tokenizer_config.json'])
  writable_dir(str(directory.parent), '--output (its folder)')
  source = corpus_lib.load(data_config)
  texts = (source.train[i][source.text_key].decode('utf-8') for i in range(len(source.train)))
  return train_hf(texts, vocab_size, output)


def _command():
  """The command line; its flags are defined only when run as a command, so importing `train`
  elsewhere (benchmarks/data_pipeline.py) defines none."""
  from ml_collections import config_flags

  from runtime import cli
  config = config_flags.DEFINE_config_file('config', None, 'Config file (its data settings).',
                                           lock_config=True)
  vocab = flags.DEFINE_integer('vocab_size', 4096, 'Pieces in the model, specials included.')
  output = flags.DEFINE_string('output', None, 'Writes OUTPUT.model and OUTPUT.vocab.')
  kind = flags.DEFINE_enum('kind', 'sentencepiece', ['sentencepiece', 'hf'],
                           'sentencepiece: OUTPUT.model; hf: OUTPUT/tokenizer.json.')
  model_type = flags.DEFINE_enum('model_type', 'bpe', ['bpe', 'unigram'], 'SentencePiece model.')
  max_lines = flags.DEFINE_integer('max_lines', 2_000_000, 'Lines SentencePiece samples.')
  flags.mark_flags_as_required(['config', 'output'])

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    if kind.value == 'hf':
      model = train_hf_on_corpus(config.value.data, vocab.value, output.value)
    else:
      model = train(config.value.data, vocab.value, output.value, model_type.value,
                    max_lines.value)
    print(f'wrote {model}; train with --config.data.tokenizer={kind.value} '
          f'--config.data.tokenizer_model={model}')

  cli.run(main)


if __name__ == '__main__':
  _command()
