"""Train a SentencePiece tokenizer on the configured corpus's training split.

  python -m data.train_tokenizer --config=configs/default.py --vocab_size=4096 \
      --output=/tmp/meshlm-spm/stdlib4k
  python train.py --config=configs/default.py --config.data.tokenizer=sentencepiece \
      --config.data.tokenizer_model=/tmp/meshlm-spm/stdlib4k.model

The model is lossless on any text (identity normalisation, whitespace kept as is, unknown
characters fall back to bytes), and has BOS=1, EOS=2, PAD=3, UNK=0. Training reads lines of the
training split's documents (at most --max_lines, sampled by SentencePiece); newlines themselves
are byte tokens.
"""

import pathlib

from absl import app, flags


def train(data_config, vocab_size: int, output: str, model_type: str = 'bpe',
          max_lines: int = 2_000_000) -> str:
  """Train on config.data's training split; returns the path of the .model file."""
  import sentencepiece

  from data import corpus as corpus_lib
  from runtime.workdir import writable_dir
  if vocab_size < 260:
    raise ValueError(f'--vocab_size={vocab_size} must be at least 260 (4 specials and 256 byte '
                     'pieces)')
  writable_dir(str(pathlib.Path(output).expanduser().parent), '--output (its folder)')
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


def _command():
  """The command line; its flags are defined only when run as a command, so importing `train`
  elsewhere (benchmarks/data_pipeline.py) defines none."""
  from ml_collections import config_flags

  from runtime import cli
  config = config_flags.DEFINE_config_file('config', None, 'Config file (its data settings).',
                                           lock_config=True)
  vocab = flags.DEFINE_integer('vocab_size', 4096, 'Pieces in the model, specials included.')
  output = flags.DEFINE_string('output', None, 'Writes OUTPUT.model and OUTPUT.vocab.')
  model_type = flags.DEFINE_enum('model_type', 'bpe', ['bpe', 'unigram'], 'SentencePiece model.')
  max_lines = flags.DEFINE_integer('max_lines', 2_000_000, 'Lines SentencePiece samples.')
  flags.mark_flags_as_required(['config', 'output'])

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    model = train(config.value.data, vocab.value, output.value, model_type.value, max_lines.value)
    print(f'wrote {model}; train with --config.data.tokenizer=sentencepiece '
          f'--config.data.tokenizer_model={model}')

  cli.run(main)


if __name__ == '__main__':
  _command()
