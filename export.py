"""Export a run's checkpoint as a Hugging Face Llama checkpoint (interop/huggingface.py).

  python export.py --workdir=/tmp/meshlm-default --output=/tmp/meshlm-hf
  python export.py --workdir=/tmp/meshlm-default --step=100 --output=/tmp/meshlm-hf --dtype=bfloat16

The directory holds config.json, model.safetensors (sharded with model.safetensors.index.json
above --max_shard_gb) and the tokenizer's files, and loads with
transformers.AutoModelForCausalLM.from_pretrained(DIR). A run with LoRA adapters is exported with
them merged into its weights, or with --lora=peft as a PEFT adapter alone (interop/peft.py):
  python export.py --workdir=/tmp/meshlm-lora --output=/tmp/meshlm-lora-adapter --lora=peft
It is written beside --output and moved there whole; an existing non-empty --output is refused,
and what an export killed on this host left beside it is cleared.
A run's draft heads (config.model.draft_heads) are left out, and it says so: no Llama, Mixtral or
Qwen3-MoE checkpoint has a place for them.
"""

import dataclasses
import pathlib

from absl import app, flags
from flax import nnx

from inference import sampling
from interop import huggingface, peft
from model.layers import Draft, split_adapters
from runtime import cli

_WORKDIR = flags.DEFINE_string('workdir', None, "A run's workdir, checkpoints/ or "
                               'checkpoints/STEP.', required=True)
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint step to export; default: the newest.')
_OUTPUT = flags.DEFINE_string('output', None, 'A new (or empty) directory to write.',
                              required=True)
_DTYPE = flags.DEFINE_enum('dtype', None, ['float32', 'bfloat16', 'float16'],
                           "The tensors' dtype; default: the run's config.model.param_dtype.")
_LORA = flags.DEFINE_enum('lora', 'merge', ['merge', 'peft'], "A run with adapters: merge them "
                          'into the weights, or write them as a PEFT adapter alone.')
_MAX_SHARD_GB = flags.DEFINE_float('max_shard_gb', 5.0, 'Safetensors files of at most this many '
                                   'GB (10^9 bytes), as transformers shards.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not _OUTPUT.value.strip():
    raise ValueError('--output is empty; give a new directory to write the export into')
  output = pathlib.Path(_OUTPUT.value).expanduser()
  huggingface.check_output(output)  # before anything is read
  if _MAX_SHARD_GB.value <= 0:
    raise ValueError(f'--max_shard_gb={_MAX_SHARD_GB.value} must be positive')
  workdir = pathlib.Path(_WORKDIR.value).expanduser()
  loaded = sampling.load(str(workdir), step=_STEP.value)
  cfg, params = loaded.model.cfg, nnx.state(loaded.model)
  if _LORA.value == 'peft':
    if not cfg.lora_rank:
      raise ValueError(f'--lora=peft: {loaded.checkpoint} has no adapters (its '
                       'config.model.lora_rank is 0); export it whole, without --lora')
    dtype = _DTYPE.value or cfg.param_dtype
    print(f'# {loaded.checkpoint} → {output} (PEFT adapter, {dtype})')
    base = loaded.init_from
    if base == 'random':  # settings.RANDOM
      print('# its base was drawn at random (config.init_from=random): no model holds it')
    elif base and not base.startswith(huggingface.PREFIX):  # a meshlm run: no model PEFT loads
      print(f'# its base is the meshlm run {base}: export that first (python export.py '
            f'--workdir={base} --output=BASE) and load the adapter onto BASE')
    peft.write(params, cfg, output, dtype=dtype, tokenizer=loaded.tokenizer,
               base_model=base.removeprefix(huggingface.PREFIX) if base.startswith(
                   huggingface.PREFIX) else '', chat_template=loaded.chat_template)
    return
  dtype = _DTYPE.value or cfg.weight_dtype.name
  print(f'# {loaded.checkpoint} → {output} ({dtype}'
        f'{", adapters merged" if cfg.lora_rank else ""})')
  if cfg.draft_heads:  # no Llama, Mixtral or Qwen3-MoE checkpoint has a place for them
    print(f'# its {cfg.draft_heads} draft heads are left out: they stay in the checkpoint, '
          'for sample.py')
    params = split_adapters(params, Draft)[1]
    cfg = dataclasses.replace(cfg, draft_heads=0)
  if cfg.lora_rank:
    params, cfg = peft.merged(params, cfg), dataclasses.replace(cfg, lora_rank=0)
  huggingface.export(params, cfg, loaded.tokenizer, loaded.run.seq_len, output, dtype=dtype,
                     max_shard_bytes=int(_MAX_SHARD_GB.value * 1e9),
                     chat_template=loaded.chat_template)


if __name__ == '__main__':
  cli.run(main)
