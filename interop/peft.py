"""LoRA adapters out of a run, in the two forms the field reads: merged into the weights (what
export.py writes for a run with adapters), or as a PEFT adapter (`export.py --lora=peft`):
`adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base_model, DIR)` puts on the base model. `load` reads such an
adapter back into meshlm's form.

meshlm's adapter of W[in…, out…] (model/layers.py: Adapter) is A[in…, r] and B[r, out…], adding
(alpha/r) · (x A) B; PEFT's of a Linear whose weight is [out, in] is lora_A.weight [r, in] and
lora_B.weight [out, r], adding (lora_alpha/r) · B_peft A_peft x. So lora_A is A flattened to
[in, r] and transposed, lora_B is B flattened to [r, out] and transposed, and each layer's are
named after the module its weight is in HF's Llama (interop/huggingface.py: TENSORS).
"""

import json
import math
import pathlib

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from interop.huggingface import LAYER, TENSORS, cast, save_tokenizer, written_whole
from model.layers import adapters_in, adapters_merged

MODULES = {'q': 'q_proj', 'k': 'k_proj', 'v': 'v_proj', 'o': 'o_proj', 'gate': 'gate_proj',
           'up': 'up_proj', 'down': 'down_proj'}
PREFIX = 'base_model.model.'  # PEFT's names wrap the model's


def _pure(params) -> dict:
  """Nested dicts of arrays, from an nnx.State or as given."""
  return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def merged(params, cfg) -> dict:
  """The parameters without adapters, each adapted weight W + (alpha/r) A B (summed in fp32, then
  in W's dtype): the model the adapters make, as a plain Llama."""
  return adapters_merged(_pure(params), cfg.lora_scale, np)


def _layers(cfg) -> int:
  """How many leading dimensions a stacked ('blocks') parameter has."""
  return 1 + (cfg.virtual_stages > 1)


def tensors(params, cfg, dtype) -> dict[str, np.ndarray]:
  """The adapters as PEFT names and lays them out, in `dtype`."""
  out = {}
  for path, adapter in adapters_in(_pure(params)):
    module = TENSORS[path].name.removesuffix('.weight')
    a, b = np.asarray(adapter['a']), np.asarray(adapter['b'])
    lead = _layers(cfg) if path[0] == 'blocks' else 0
    for i in range(math.prod(a.shape[:lead])):
      at = np.unravel_index(i, a.shape[:lead])
      a_i, b_i = a[at], b[at]
      name = PREFIX + (LAYER.format(i) if lead else '') + module
      out[f'{name}.lora_A.weight'] = np.ascontiguousarray(
          cast(a_i.reshape(-1, a_i.shape[-1]).T, np.dtype(dtype), f'{name}.lora_A.weight'))
      out[f'{name}.lora_B.weight'] = np.ascontiguousarray(
          cast(b_i.reshape(b_i.shape[0], -1).T, np.dtype(dtype), f'{name}.lora_B.weight'))
  return out


def adapter_config(cfg, base_model: str) -> dict:
  """PEFT's LoraConfig for these adapters: plain LoRA (no rsLoRA, no DoRA, no dropout)."""
  return {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': cfg.lora_rank,
          'lora_alpha': cfg.lora_alpha, 'lora_dropout': 0.0,
          'target_modules': sorted(MODULES[t] for t in cfg.lora_target_names), 'bias': 'none',
          'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
          'init_lora_weights': True, 'inference_mode': True,
          'base_model_name_or_path': base_model, 'modules_to_save': None,
          'layers_to_transform': None, 'layers_pattern': None, 'rank_pattern': {},
          'alpha_pattern': {}, 'revision': None}


def write(params, cfg, output: pathlib.Path, *, dtype: str, base_model: str,
          tokenizer=None, chat_template: str | None = None, log=print) -> None:
  """adapter_config.json and adapter_model.safetensors (and the tokenizer's files, with the
  run's chat template) in `output`, built beside it and renamed to it whole, as
  interop.huggingface.export does."""
  np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == 'bfloat16' else dtype)
  with written_whole(output) as partial:
    arrays = tensors(params, cfg, np_dtype)
    save_file(arrays, partial / 'adapter_model.safetensors', metadata={'format': 'pt'})
    (partial / 'adapter_config.json').write_text(
        json.dumps(adapter_config(cfg, base_model), indent=2) + '\n')
    if tokenizer is not None:
      save_tokenizer(tokenizer, partial, chat_template, log=lambda *_: None)
    log(f'wrote adapter_model.safetensors ({len(arrays)} tensors, '
        f'{sum(a.nbytes for a in arrays.values()) / 2**20:,.2f} MiB) and adapter_config.json '
        f'(r={cfg.lora_rank}, lora_alpha={cfg.lora_alpha}, base {base_model or "unnamed"})')


def load(path: pathlib.Path, params, cfg) -> dict:
  """`params` (a pure dict or State, adapters included) with its adapters read from the PEFT
  adapter in `path`, whose r, alpha and targets must be this model's."""
  config = json.loads((path / 'adapter_config.json').read_text())
  mine = adapter_config(cfg, '')
  for key in ('r', 'lora_alpha', 'target_modules'):
    theirs = sorted(config[key]) if key == 'target_modules' else config[key]
    if theirs != mine[key]:
      raise ValueError(f'{path}: its adapter_config.json has {key}={config[key]!r}, this model '
                       f'{mine[key]!r} (config.model.lora_rank, lora_alpha, lora_targets)')
  params = _pure(params)
  with safe_open(path / 'adapter_model.safetensors', framework='numpy') as f:
    found = {name: f.get_tensor(name) for name in f.keys()}
  for weight_path, adapter in adapters_in(params):
    lead = _layers(cfg) if weight_path[0] == 'blocks' else 0
    name = TENSORS[weight_path].name.removesuffix('.weight')
    a, b = np.array(adapter['a']), np.array(adapter['b'])
    for i in range(math.prod(a.shape[:lead])):
      at = np.unravel_index(i, a.shape[:lead])
      where = PREFIX + (LAYER.format(i) if lead else '') + name
      a[at] = found[f'{where}.lora_A.weight'].T.reshape(a[at].shape)
      b[at] = found[f'{where}.lora_B.weight'].T.reshape(b[at].shape)
    adapter['a'], adapter['b'] = a, b
  return params
