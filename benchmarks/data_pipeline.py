"""Packed tokens per second that one host's data pipeline delivers, per tokenizer and worker count.

  python -m benchmarks.data_pipeline --config=configs/default.py
  python -m benchmarks.data_pipeline --config=configs/llama.py:1b --workers=0,2,8 \
      --spm_model=/tmp/meshlm-spm/stdlib4k.model

Method: the training pipeline exactly as train.py builds it (TFDS array_record source → grain
shuffle → tokenize → pack → batch; worker processes when --workers > 0), for one process holding
every row of the global batch (config.batch_size × config.seq_len). After --warmup batches (worker
start-up is excluded; it is reported separately as the first batch's latency), --batches batches
are timed back to back as numpy on the host. Tokens counted are packed (input, target) pairs with
weight 1, so padding would not count (training rows have none). Without --spm_model, a 4,096-piece
SentencePiece model is trained on the corpus first (its time is reported).

Goal: ≥ 1M packed tokens/s with the byte tokenizer on a 2-core machine, and ≥ 700k tokens/s on a GPU
host (the 1B preset at the MFU goal on its 8 GPUs).
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
from data import pipeline, tokenizers, train_tokenizer
from runtime import cli
from training import settings

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file.',
                                          lock_config=True)
_WORKERS = flags.DEFINE_list('workers', ['0', '1', '2'], 'Worker counts to measure.')
_BATCHES = flags.DEFINE_integer('batches', 300, 'Timed batches per measurement.')
_WARMUP = flags.DEFINE_integer('warmup', 20, 'Untimed batches first.')
_SPM = flags.DEFINE_string('spm_model', None, 'SentencePiece model; trained here if not given.')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON figures to this file.')


def measure(corpus, tokenizer, config, workers: int) -> dict:
  one_host = NamedSharding(jax.make_mesh((1,), ('data',), devices=jax.devices()[:1]),
                           PartitionSpec('data'))
  config.data.workers = workers
  start = time.perf_counter()
  batches = pipeline.train_batches(corpus, tokenizer, config, one_host)
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
  return {'tokenizer': tokenizer.name, 'workers': workers, 'tokens_per_sec': tokens / seconds,
          'packing_efficiency': tokens / slots, 'first_batch_s': first_s}


def main(argv):
  del argv
  config = settings.resolve(_CONFIG.value).config
  corpus = corpus_lib.load(config.data)
  spm_model, spm_train_s = _SPM.value, None
  if not spm_model:
    start = time.perf_counter()
    spm_model = train_tokenizer.train(config.data, 4096, os.path.join(tempfile.mkdtemp(), 'spm'))
    spm_train_s = time.perf_counter() - start
  results = []
  for tokenizer in (tokenizers.ByteTokenizer(), tokenizers.SentencePieceTokenizer(spm_model)):
    for workers in map(int, _WORKERS.value):
      results.append(measure(corpus, tokenizer, config, workers))
      r = results[-1]
      print(f'  {r["tokenizer"]:<13} workers={workers}: {r["tokens_per_sec"]:,.0f} tokens/s',
            flush=True)

  figures = {
      'benchmark': 'data_pipeline', 'config': config_flags.get_config_filename(flags.FLAGS['config']),
      'corpus': corpus.description, 'host': platform.processor() or platform.machine(),
      'cpu_count': os.cpu_count(), 'batch_size': config.batch_size, 'seq_len': config.seq_len,
      'batches': _BATCHES.value, 'spm_model': spm_model, 'spm_train_s': spm_train_s,
      'results': results, 'command': report.command(),
  }
  print(f'\n{corpus.description}; {config.batch_size} × {config.seq_len} tokens a batch; '
        f'{os.cpu_count()} CPUs')
  print(f'{"tokenizer":<14}{"workers":>8}{"tokens/s":>14}{"packed":>9}{"first batch":>13}')
  for r in results:
    print(f'{r["tokenizer"]:<14}{r["workers"]:>8}{r["tokens_per_sec"]:>14,.0f}'
          f'{r["packing_efficiency"]:>9.1%}{r["first_batch_s"]:>12.2f}s')
  report.emit(figures, _OUT.value)


if __name__ == '__main__':
  cli.run(main)
