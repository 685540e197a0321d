"""Export a run's checkpoint as a Hugging Face Llama checkpoint (runtime/huggingface.py).

  python export.py --workdir=/tmp/meshlm-default --output=/tmp/meshlm-hf
  python export.py --workdir=/tmp/meshlm-default --step=100 --output=/tmp/meshlm-hf --dtype=bfloat16

The directory holds config.json, model.safetensors (sharded with model.safetensors.index.json
above --max_shard_gb) and the tokenizer's files, and loads with
transformers.AutoModelForCausalLM.from_pretrained(DIR). It is written beside --output and moved
there whole; an existing non-empty --output is refused.
"""

import pathlib

from absl import app, flags
from flax import nnx

from runtime import cli, huggingface
from training import sampling

_WORKDIR = flags.DEFINE_string('workdir', None, "A run's workdir, checkpoints/ or "
                               'checkpoints/STEP.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint step to export; default: the newest.')
_OUTPUT = flags.DEFINE_string('output', None, 'A new (or empty) directory to write.',
                              required=True)
_DTYPE = flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16', 'float16'],
                           "The tensors' dtype; default: the run's config.model.param_dtype.")
_MAX_SHARD_GB = flags.DEFINE_float('max_shard_gb', 5.0, 'Safetensors files of at most this many '
                                   'GB (10^9 bytes), as transformers shards.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  output = pathlib.Path(_OUTPUT.value).expanduser()
  huggingface.check_output(output)  # before anything is read
  if _MAX_SHARD_GB.value <= 0:
    raise ValueError(f'--max_shard_gb={_MAX_SHARD_GB.value} must be positive')
  workdir = pathlib.Path(_WORKDIR.value).expanduser()
  loaded = sampling.load(str(workdir), step=_STEP.value)
  dtype = _DTYPE.value or loaded.config.model.param_dtype
  print(f'# {loaded.checkpoint} → {output} ({dtype})')
  huggingface.export(nnx.state(loaded.model), loaded.model.cfg, loaded.tokenizer,
                     loaded.config.seq_len, output, dtype=dtype,
                     max_shard_bytes=int(_MAX_SHARD_GB.value * 1e9))


if __name__ == '__main__':
  cli.run(main)
