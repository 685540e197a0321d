"""Packed tokens per second that one host's data pipeline delivers, per tokenizer, tokenized once
or on the fly (data/tokens.py), and worker count.

  python -m benchmarks.data_pipeline --config=configs/default.py
  python -m benchmarks.data_pipeline --config=configs/llama.py:1b --workers=0,2,8 \
      --spm_model=/tmp/meshlm-spm/stdlib4k.model --hf_model=/tmp/meshlm-bpe32k/tokenizer.json

Method: the training pipeline exactly as train.py builds it (TFDS array_record source → the
documents' token ids, stored or encoded as packing asks → grain shuffle → pack → batch; worker
processes when --workers > 0), for one process holding every row of the global batch
(config.batch_size × config.seq_len). After --warmup batches (worker start-up is excluded; it is
reported separately as the first batch's latency, preparation not included), --batches batches
are timed back to back as numpy on the host. Tokens counted are packed (input, target) pairs with
weight 1, so padding would not count (training rows have none). Without --spm_model, a 4,096-piece
SentencePiece model is trained on the corpus first, and without --hf_model a 32,000-id byte-level
BPE (the `tokenizers` library); their training and each preparation of token ids are timed.

Goal: ≥ 5M packed tokens/s from prepared ids and ≥ 1.5M on the fly, with the 32k BPE on a
2-core machine; ≥ 700k tokens/s a host feeds the 1b preset's 8 GPUs at the MFU goal.
"""

import os
import platform
import tempfile
import time

import jax
from absl import flags
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from benchmarks import report
from data import corpus as corpus_lib
from data import tokenizers, train_tokenizer
from data import tokens as data_tokens
from runtime import cli
from training import loop, settings

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file.',
                                          lock_config=True)
_WORKERS = flags.DEFINE_list('workers', ['0', '1', '2'], 'Worker counts to measure.')
_BATCHES = flags.DEFINE_integer('batches', 300, 'Timed batches per measurement.')
_WARMUP = flags.DEFINE_integer('warmup', 20, 'Untimed batches first.')
_SPM = flags.DEFINE_string('spm_model', None, 'SentencePiece model; trained here if not given.')
_HF = flags.DEFINE_string('hf_model', None, 'tokenizer.json; a 32k BPE trained here if not given.')
_MODES = flags.DEFINE_list('tokenize', ['on_the_fly', 'once'], 'config.data.tokenize values.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def measure(train_documents, run, workers: int) -> dict:
  one_host = NamedSharding(jax.make_mesh((1,), ('data',), devices=jax.devices()[:1]),
                           PartitionSpec('data'))
  config, tokenizer = run.replace(data={'workers': workers}), run.tokenizer
  start = time.perf_counter()
  batches = loop.train_batches(config, train_documents, one_host)
  batches.next_local()
  first_s = time.perf_counter() - start
  for _ in range(_WARMUP.value):
    batches.next_local()
  tokens, start = 0.0, time.perf_counter()
  for _ in range(_BATCHES.value):
    tokens += float(batches.next_local()['weights'].sum())
  seconds = time.perf_counter() - start
  batches.close()
  slots = _BATCHES.value * config.batch_size * config.seq_len
  return {'tokenizer': tokenizer.name, 'tokenize': config.data.tokenize, 'workers': workers,
          'tokens_per_sec': tokens / seconds, 'packing_efficiency': tokens / slots,
          'first_batch_s': first_s}


def timed(fn, *args):
  start = time.perf_counter()
  return fn(*args), time.perf_counter() - start


def main(argv):
  del argv
  config = settings.resolve(_CONFIG.value)
  corpus = corpus_lib.load(config.data)
  scratch = tempfile.mkdtemp()
  spm_model, spm_train_s = _SPM.value, None
  if not spm_model:
    spm_model, spm_train_s = timed(train_tokenizer.train, config.data, 4096,
                                   os.path.join(scratch, 'spm'))
  hf_model, hf_train_s = _HF.value, None
  if not hf_model:
    hf_model, hf_train_s = timed(train_tokenizer.train_hf_on_corpus, config.data, 32000,
                                 os.path.join(scratch, 'bpe32k'))
  results, prepare_s = [], {}
  for tokenizer in (tokenizers.ByteTokenizer(), tokenizers.SentencePieceTokenizer(spm_model),
                    tokenizers.HFTokenizer(hf_model)):
    for mode in _MODES.value:
      config = config.replace(data={'tokenize': mode}, tokenizer=tokenizer)
      # Prepared afresh in a scratch data dir, so the time is the preparation's.
      documents, seconds = timed(data_tokens.load, corpus, tokenizer, config.data, scratch)
      if mode == 'once':
        prepare_s[tokenizer.name] = seconds
      for workers in map(int, _WORKERS.value):
        results.append(measure(documents.train, config, workers))
        r = results[-1]
        print(f'  {r["tokenizer"]:<13} {mode:<10} workers={workers}: '
              f'{r["tokens_per_sec"]:,.0f} tokens/s', flush=True)

  figures = {
      'benchmark': 'data_pipeline', 'config': config_flags.get_config_filename(flags.FLAGS['config']),
      'corpus': corpus.description, 'host': platform.processor() or platform.machine(),
      'cpu_count': os.cpu_count(), 'batch_size': config.batch_size, 'seq_len': config.seq_len,
      'batches': _BATCHES.value, 'spm_model': spm_model, 'spm_train_s': spm_train_s,
      'hf_model': hf_model, 'hf_train_s': hf_train_s, 'prepare_s': prepare_s,
      'results': results, 'command': report.command(),
  }
  print(f'\n{corpus.description}; {config.batch_size} × {config.seq_len} tokens a batch; '
        f'{os.cpu_count()} CPUs; token ids prepared in '
        + ', '.join(f'{name} {s:.1f}s' for name, s in prepare_s.items()))
  print(f'{"tokenizer":<14}{"tokenize":<12}{"workers":>8}{"tokens/s":>14}{"packed":>9}'
        f'{"first batch":>13}')
  for r in results:
    print(f'{r["tokenizer"]:<14}{r["tokenize"]:<12}{r["workers"]:>8}{r["tokens_per_sec"]:>14,.0f}'
          f'{r["packing_efficiency"]:>9.1%}{r["first_batch_s"]:>12.2f}s')
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
