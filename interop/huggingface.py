"""Hugging Face checkpoints in and out: Llama, Qwen3, Mixtral and Qwen3-MoE (`FAMILIES`).
meshlm's model computes the function of transformers' `LlamaForCausalLM` (or the family's
`...ForCausalLM`) for the same weights, so a checkpoint is a renaming and a re-layout of tensors
(`TENSORS`, and a family's own in `FAMILY_TENSORS`).

Import, `--config.init_from=hf:DIR` (DIR holds config.json and model.safetensors, or the shards a
model.safetensors.index.json names): `model_settings` gives config.model's fields from
config.json (training/settings.py takes them, and the tokenizer.json beside it), `check_tensors` finds
every tensor with its shape before anything is compiled, and `load_params` reads each device's
share of each tensor straight into the run's shardings.

Export, `python export.py --workdir=RUN --output=DIR` (`export`): config.json, safetensors in HF
layout (sharded above a size, with an index) and the tokenizer's files, written beside DIR and
moved into place whole.
"""

import contextlib
import dataclasses
import functools
import glob
import json
import math
import os
import pathlib
import shutil
import socket
import tempfile

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from configs import schema
from configs.base import ModelConfig
from runtime import faults

PREFIX = 'hf:'
SETTING = 'config.init_from'
LAYER = 'model.layers.{}.'  # before the name of a stacked ('blocks') parameter's tensor


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a meshlm parameter is in a HF checkpoint: tensor `name` (after model.layers.{i}. for
  the stacked 'blocks', once per layer), transposed or not, with meshlm's two dimensions
  `joined` = (d, d + 1) one HF dimension: q_proj [N·H, D] is Wq[D, N, H] (joined (1, 2)),
  o_proj [D, N·H] is Wo[N, H, D] (joined (0, 1))."""
  name: str
  transposed: bool = False
  joined: tuple = ()
  experts: bool = False  # one tensor per expert: `name` has {} for its index

  def hf_name(self, index: int, n_experts: int) -> str:
    """The HF name of the flat `index`-th (layer, expert) tensor of a stacked parameter."""
    if not self.experts:
      return LAYER.format(index) + self.name
    return LAYER.format(index // n_experts) + self.name.format(index % n_experts)

  def groups(self, ndim) -> list[tuple]:
    """meshlm's dimensions (per layer) as HF's, in meshlm's order."""
    return [tuple(self.joined) if d in self.joined else (d,) for d in range(ndim)
            if not self.joined or d != self.joined[1]]

  def hf_shape(self, shape) -> tuple:
    joined = [math.prod(shape[d] for d in group) for group in self.groups(len(shape))]
    return tuple(joined[::-1] if self.transposed else joined)

  def to_hf(self, x):
    """meshlm's array (one layer) in HF's layout."""
    x = x.reshape(self.hf_shape(x.shape)[::-1] if self.transposed else self.hf_shape(x.shape))
    return x.T if self.transposed else x


TENSORS = {
    ('embed',): Layout('model.embed_tokens.weight'),
    ('blocks', 'attn_norm', 'scale'): Layout('input_layernorm.weight'),
    ('blocks', 'attn', 'wq'): Layout('self_attn.q_proj.weight', True, (1, 2)),
    ('blocks', 'attn', 'wk'): Layout('self_attn.k_proj.weight', True, (1, 2)),
    ('blocks', 'attn', 'wv'): Layout('self_attn.v_proj.weight', True, (1, 2)),
    ('blocks', 'attn', 'wo'): Layout('self_attn.o_proj.weight', True, (0, 1)),
    ('blocks', 'mlp_norm', 'scale'): Layout('post_attention_layernorm.weight'),
    ('blocks', 'mlp', 'w_gate'): Layout('mlp.gate_proj.weight', True),
    ('blocks', 'mlp', 'w_up'): Layout('mlp.up_proj.weight', True),
    ('blocks', 'mlp', 'w_down'): Layout('mlp.down_proj.weight', True),
    ('final_norm', 'scale'): Layout('model.norm.weight'),
    ('unembed',): Layout('lm_head.weight', True),
}
# Each family's tensors beside or in place of Llama's. Qwen3's per-head q/k norms; an MoE's in
# place of the MLP's, its experts' weights [E, ...] as E tensors: Mixtral's, and Qwen3-MoE's,
# which has Qwen3's q/k norms too.
QK_NORMS = {
    ('blocks', 'attn', 'q_norm', 'scale'): Layout('self_attn.q_norm.weight'),
    ('blocks', 'attn', 'k_norm', 'scale'): Layout('self_attn.k_norm.weight'),
}
FAMILY_TENSORS = {
    'llama': {},
    'qwen3': QK_NORMS,
    # Gemma 3's four norms a layer: its post_attention_layernorm is on attention's output (Llama's
    # is the MLP's input norm, here pre_feedforward_layernorm).
    'gemma3_text': {
        **QK_NORMS,
        ('blocks', 'attn_post_norm', 'scale'): Layout('post_attention_layernorm.weight'),
        ('blocks', 'mlp_norm', 'scale'): Layout('pre_feedforward_layernorm.weight'),
        ('blocks', 'mlp_post_norm', 'scale'): Layout('post_feedforward_layernorm.weight'),
    },
    'mixtral': {
        ('blocks', 'mlp', 'router'): Layout('block_sparse_moe.gate.weight', True),
        ('blocks', 'mlp', 'w_gate'): Layout('block_sparse_moe.experts.{}.w1.weight', True, (),
                                            True),
        ('blocks', 'mlp', 'w_up'): Layout('block_sparse_moe.experts.{}.w3.weight', True, (), True),
        ('blocks', 'mlp', 'w_down'): Layout('block_sparse_moe.experts.{}.w2.weight', True, (),
                                            True),
    },
    'qwen3_moe': {
        ('blocks', 'mlp', 'router'): Layout('mlp.gate.weight', True),
        ('blocks', 'mlp', 'w_gate'): Layout('mlp.experts.{}.gate_proj.weight', True, (), True),
        ('blocks', 'mlp', 'w_up'): Layout('mlp.experts.{}.up_proj.weight', True, (), True),
        ('blocks', 'mlp', 'w_down'): Layout('mlp.experts.{}.down_proj.weight', True, (), True),
        **QK_NORMS,
    },
}
FAMILIES = tuple(FAMILY_TENSORS)  # the model_types meshlm imports and exports
MOE_FAMILIES = ('mixtral', 'qwen3_moe')
# Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration): the text model's tensors under
# these prefixes (the Hub's and transformers 4's, then transformers 5's own), the vision tower's
# and projector's under OTHER_TOWERS
TEXT_PREFIXES = {'language_model.model.': 'model.', 'language_model.lm_head.': 'lm_head.',
                 'model.language_model.': 'model.'}
OTHER_TOWERS = ('vision_tower.', 'multi_modal_projector.', 'model.vision_tower.',
                'model.multi_modal_projector.')
IGNORED = ('rotary_emb.inv_freq',)  # buffers older transformers saved; recomputed from the config
DTYPES = {'F32': np.float32, 'BF16': ml_dtypes.bfloat16, 'F16': np.float16}

# config.model field ← config.json key (transformers' LlamaConfig; its defaults where absent).
FIELDS = schema.hf_names(ModelConfig)  # config.model's field: its config.json key, as declared
LLAMA3_FIELDS = ('rope_factor', 'rope_low_freq_factor', 'rope_high_freq_factor',
                 'rope_original_length')
# An MoE's experts: transformers' MixtralConfig's names (Qwen3MoeConfig's after the slash). Both
# route by a softmax top-k (Mixtral's renormalised), and weigh a load-balancing loss k times
# meshlm's (model/moe.py).
MOE_FIELDS = {'experts': 'num_local_experts/num_experts',
              'experts_per_token': 'num_experts_per_tok',
              'expert_d_ff': 'intermediate_size/moe_intermediate_size',
              'load_balance_loss': 'router_aux_loss_coef', 'router': 'model_type',
              'router_renormalize': 'model_type/norm_topk_prob', 'shared_experts': 'model_type',
              'dense_layers': 'model_type', 'qk_norm': 'model_type'}


def family(cfg) -> str:
  """The HF model_type whose checkpoints hold this model: Qwen3's have q/k norms, Gemma 3's
  norms scale by (1 + w)."""
  if cfg.norm_plus_one and not cfg.experts:
    return 'gemma3_text'
  if not cfg.experts:
    return 'qwen3' if cfg.qk_norm else 'llama'
  return 'qwen3_moe' if cfg.qk_norm else 'mixtral'


def directory(init_from: str) -> pathlib.Path | None:
  """The directory of `config.init_from='hf:DIR'`, else None (a meshlm run or nothing)."""
  if not init_from.startswith(PREFIX):
    return None
  path = pathlib.Path(init_from[len(PREFIX):]).expanduser()
  if not (path / 'config.json').is_file():
    raise ValueError(f'{SETTING}={init_from!r}: {path} holds no config.json; give a directory '
                     'with a Hugging Face checkpoint (config.json and model.safetensors)')
  return path


def model_settings(path: pathlib.Path) -> dict:
  """config.model's fields from the config.json of a family of FAMILIES (transformers 4's
  `rope_scaling` and `rope_theta` or 5's `rope_parameters`); anything meshlm does not compute
  exactly is an error naming the key."""
  where = f'{SETTING}={PREFIX}{path}: its config.json'
  try:
    hf = json.loads((path / 'config.json').read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f'{where} is not JSON ({e}); copy the checkpoint again') from None
  model_type = hf.get('model_type')
  if model_type == 'gemma3_text':
    return _gemma3_settings(hf, where)
  if model_type == 'gemma3':  # with a vision tower: its text model (Checkpoint leaves the rest)
    text = {'tie_word_embeddings': hf.get('tie_word_embeddings', True),
            **(hf.get('text_config') or {})}
    return _gemma3_settings(text, where + "'s text_config")
  rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  rope_type = rope.get('rope_type', rope.get('type', 'default'))
  unsupported = {
      'model_type': model_type not in FAMILIES,
      'hidden_act': hf.get('hidden_act', 'silu') != 'silu',
      'attention_bias': hf.get('attention_bias', False),
      'mlp_bias': hf.get('mlp_bias', False),
      'num_local_experts': 'num_local_experts' in hf and model_type == 'llama',
      'mlp_only_layers': bool(hf.get('mlp_only_layers')),
      'decoder_sparse_step': hf.get('decoder_sparse_step', 1) != 1,
      'use_sliding_window': hf.get('use_sliding_window', False),
      'rope_type': rope_type not in ('default', 'llama3'),
      'sliding_window': hf.get('sliding_window') is not None,
      'layer_types': any(t != 'full_attention' for t in hf.get('layer_types') or ()),
      'router_jitter_noise': bool(hf.get('router_jitter_noise')),
  }
  if bad := [key for key, is_bad in unsupported.items() if is_bad]:
    raise ValueError(f'{where} has {", ".join(f"{k}={hf.get(k, rope_type)!r}" for k in bad)}; '
                     "meshlm imports Llama, Qwen3, Mixtral, Qwen3-MoE and Gemma 3 (model_type "
                     f"{' or '.join(map(repr, FAMILIES))}: SwiGLU, no biases, full causal "
                     "attention, every layer's experts alike, rope_type 'default' or 'llama3')")
  required = ['vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
              'intermediate_size'] + [key for f, key in FIELDS.items()
                                      if f in LLAMA3_FIELDS and rope_type == 'llama3']
  if missing := [key for key in required if key not in {**hf, **rope}]:
    raise ValueError(f'{where} lacks {missing}; it is not a whole {model_type} config')
  heads = hf['num_attention_heads']
  values = {**hf, **rope, 'rope_type': rope_type,
            'rope_theta': float(rope.get('rope_theta', hf.get('rope_theta', 10_000.0))),
            'num_key_value_heads': hf.get('num_key_value_heads') or heads,
            'head_dim': hf.get('head_dim') or hf['hidden_size'] // heads,
            'rms_norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
            'tie_word_embeddings': hf.get('tie_word_embeddings', False),
            'max_position_embeddings': int(hf.get('max_position_embeddings') or 0)}
  fields = {f: values[key] for f, key in FIELDS.items()
            if rope_type == 'llama3' or f not in LLAMA3_FIELDS}
  for field in LLAMA3_FIELDS[:3]:
    if field in fields:
      fields[field] = float(fields[field])
  fields.update(experts=0, qk_norm=model_type in ('qwen3', 'qwen3_moe'))
  if model_type in MOE_FAMILIES:
    k = hf.get('num_experts_per_tok', 2)
    mixtral = model_type == 'mixtral'
    fields.update(
        # transformers 5 names Qwen3-MoE's experts as Mixtral's; 4 (the Hub's configs) did not
        experts=hf.get('num_local_experts') or hf.get('num_experts', 8),
        experts_per_token=k,
        expert_d_ff=hf['intermediate_size'] if mixtral else hf.get('moe_intermediate_size', 768),
        router='softmax', router_renormalize=mixtral or hf.get('norm_topk_prob', False),
        shared_experts=0, dense_layers=0,
        load_balance_loss=float(hf.get('router_aux_loss_coef', 0.001)) * k)
  return fields


GEMMA3_ROPE = ('default', 'linear')  # the rope_types of Gemma 3's checkpoints


# transformers' Gemma3TextConfig's defaults, which a config.json may leave out (the Hub's
# multimodal ones leave most of their text_config out)
GEMMA3_DEFAULTS = {'vocab_size': 262_208, 'hidden_size': 2304, 'intermediate_size': 9216,
                   'num_hidden_layers': 26, 'num_attention_heads': 8, 'num_key_value_heads': 4,
                   'head_dim': 256, 'query_pre_attn_scalar': 256, 'sliding_window': 4096,
                   'rms_norm_eps': 1e-6, 'max_position_embeddings': 131_072,
                   'tie_word_embeddings': True}


def _gemma3_settings(hf: dict, where: str) -> dict:
  """config.model's fields from a Gemma 3 text model's config.json (Gemma3TextConfig's keys, its
  defaults where absent: transformers 5's `rope_parameters` by layer type, or 4's `rope_theta`,
  `rope_local_base_freq` and `rope_scaling`); which layers are global comes from `layer_types`
  (or the older `sliding_window_pattern`), and must repeat every N-th layer, as global_every
  says."""
  hf = {**GEMMA3_DEFAULTS, **hf}
  layers = hf['num_hidden_layers']
  pattern = hf.get('sliding_window_pattern', hf.get('_sliding_window_pattern', 6))
  types = hf.get('layer_types') or ['sliding_attention' if (i + 1) % pattern else 'full_attention'
                                    for i in range(layers)]
  globals_ = [i for i, t in enumerate(types) if t == 'full_attention']
  every = globals_[0] + 1 if globals_ else 0
  rope = hf.get('rope_parameters') or {}
  full = rope.get('full_attention') or {'rope_theta': hf.get('rope_theta', 1e6),
                                        **(hf.get('rope_scaling') or {})}
  local = rope.get('sliding_attention') or {'rope_theta': hf.get('rope_local_base_freq', 1e4)}
  full_type = full.get('rope_type', full.get('type', 'default'))
  unsupported = {
      'hidden_activation': hf.get('hidden_activation', hf.get('hidden_act',
                                                              'gelu_pytorch_tanh'))
                           not in ('gelu_pytorch_tanh', 'gelu_tanh'),
      'attention_bias': hf.get('attention_bias', False),
      'final_logit_softcapping': hf.get('final_logit_softcapping') is not None,
      'attn_logit_softcapping': hf.get('attn_logit_softcapping') is not None,
      'use_bidirectional_attention': hf.get('use_bidirectional_attention', False),
      'layer_types': (len(types) != layers or set(types) - {'sliding_attention', 'full_attention'}
                      or types != ['full_attention' if every and (i + 1) % every == 0
                                   else 'sliding_attention' for i in range(layers)]),
      'rope_parameters': (full_type not in GEMMA3_ROPE
                          or local.get('rope_type', 'default') != 'default'),
  }
  if bad := [key for key, is_bad in unsupported.items() if is_bad]:
    raise ValueError(f'{where} has {", ".join(f"{k}={hf.get(k, rope)!r}" for k in bad)}; '
                     "meshlm imports Gemma 3's text models (model_type 'gemma3_text': GeGLU with "
                     'tanh GELU, no softcapping, causal attention, every N-th layer global, '
                     "rope_type 'default' or 'linear')")
  window = hf.get('sliding_window') or 0
  return {
      'vocab_size': hf['vocab_size'], 'd_model': hf['hidden_size'], 'n_layers': layers,
      'n_heads': hf['num_attention_heads'],
      'n_kv_heads': hf.get('num_key_value_heads') or hf['num_attention_heads'],
      'head_dim': hf['head_dim'], 'd_ff': hf['intermediate_size'],
      'rope_theta': float(full.get('rope_theta', 1e6)), 'rope_type': full_type,
      **({'rope_factor': float(full['factor'])} if full_type == 'linear' else {}),
      'rope_local_theta': float(local.get('rope_theta', 1e4)) if window and every != 1 else 0.0,
      'max_position_embeddings': int(hf.get('max_position_embeddings') or 0),
      'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
      'tie_embeddings': hf.get('tie_word_embeddings', True),
      'qk_norm': True, 'norm_plus_one': True, 'post_norms': True, 'embed_scale': True,
      'mlp_activation': 'gelu_tanh', 'query_scale': float(hf.get('query_pre_attn_scalar', 256)),
      'sliding_window': window if every != 1 else 0, 'global_every': every if window else 0,
      'experts': 0,
  }


def source(field: str, value) -> str:
  """Where config.json gives config.model.`field`, for an error: 'hidden_size=2048'."""
  if field in FIELDS:
    return f'{FIELDS[field]}={value!r}'
  return f'{MOE_FIELDS.get(field, "model_type")} giving {value!r}'


def _parameters(abstract_params, cfg):
  """(leaf path, leaf, Layout, lead) of each meshlm parameter; the stacked ones have `lead`
  leading dimensions, each index one HF tensor: the layers [n], or [V, n/V] (layer v·n/V + j at
  [v, j]) with virtual stages, then an MoE layer's experts [E]."""
  tensors = {**TENSORS, **FAMILY_TENSORS[family(cfg)]}
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
    names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    layout = tensors[names]
    lead = (1 + (cfg.virtual_stages > 1)) * (names[0] == 'blocks') + layout.experts
    yield path, leaf, layout, lead


def _hf_names(layout: Layout, leaf, lead: int) -> list[str]:
  if not lead:
    return [layout.name]
  experts = leaf.shape[lead - 1] if layout.experts else 1
  return [layout.hf_name(i, experts) for i in range(math.prod(leaf.shape[:lead]))]


class Checkpoint(contextlib.ExitStack):
  """A HF checkpoint's safetensors files, open for reading tensors by name (a context)."""

  def __init__(self, path: pathlib.Path):
    super().__init__()
    where = f'{SETTING}={PREFIX}{path}'
    index = path / 'model.safetensors.index.json'
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())['weight_map']
      except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f'{where}: {index} is not a safetensors index ({type(e).__name__}: '
                         f'{e}); copy the checkpoint again') from None
    elif (path / 'model.safetensors').is_file():
      weight_map = None
    else:
      raise ValueError(f'{where} holds neither model.safetensors nor model.safetensors.index.json;'
                       ' give the directory transformers saved the model into')
    files = {}
    for file in sorted(set(weight_map.values())) if weight_map else ['model.safetensors']:
      if not (path / file).is_file():
        raise ValueError(f'{where}: {index.name} names {file}, which is not there; copy the '
                         'whole checkpoint')
      try:
        files[file] = self.enter_context(safe_open(path / file, framework='numpy'))
      except Exception as e:  # safetensors' own error type, for a truncated or damaged file
        raise ValueError(f'{where}: {path / file} does not read ({str(e).splitlines()[0]}); it '
                         'is truncated or damaged: copy the checkpoint again') from None
    if weight_map is None:
      weight_map = {name: 'model.safetensors' for name in files['model.safetensors'].keys()}
    self.where = where
    # A multimodal checkpoint's text model under its own prefix, as the text model's names; its
    # other towers left out (and `left_out` says which)
    self.left_out = {name: tuple(files[file].get_slice(name).get_shape())
                     for name, file in weight_map.items() if name.startswith(OTHER_TOWERS)}
    self.tensors = {_text_name(name): files[file].get_slice(name)
                    for name, file in weight_map.items() if not name.startswith(OTHER_TOWERS)}

  def check_tensors(self, abstract_params, cfg) -> None:
    """ValueError unless every parameter's tensors are here with the shapes the model's settings
    give them, in a float dtype, and nothing else is (biases, experts: not this model)."""
    wanted = set()
    for _, leaf, layout, lead in _parameters(abstract_params, cfg):
      shape = layout.hf_shape(leaf.shape[lead:])
      for name in _hf_names(layout, leaf, lead):
        wanted.add(name)
        if name not in self.tensors:
          raise ValueError(f'{self.where} lacks tensor {name}; its config.json describes '
                           'another model than its weights')
        found = self.tensors[name]
        if tuple(found.get_shape()) != shape or found.get_dtype() not in DTYPES:
          raise ValueError(f'{self.where}: tensor {name} is {found.get_dtype()} '
                           f'{found.get_shape()}, not {list(shape)} in one of {sorted(DTYPES)} '
                           'as its config.json implies')
    unused = {n for n in self.tensors if n not in wanted and not n.endswith(IGNORED)
              and n != TENSORS['unembed',].name}  # a tied head may be saved as well
    if unused:
      raise ValueError(f'{self.where} holds tensors meshlm\'s {family(cfg)} has no place for, '
                       f'such as {sorted(unused)[:3]}; it is not a plain {family(cfg)} checkpoint')

  def read(self, name: str, layout: Layout, shape: tuple, index: list) -> np.ndarray:
    """meshlm's part `index` ((start, stop) per dimension) of one layer's parameter of `shape`,
    reading only the rows and columns of tensor `name` it needs."""
    hf_slices, view, within = [], [], []
    for group in layout.groups(len(shape)):
      (start, stop), rest = index[group[0]], group[1:]
      size = math.prod(shape[d] for d in rest)
      hf_slices.append(slice(start * size, stop * size))
      view += [stop - start, *(shape[d] for d in rest)]
      within += [slice(None), *(slice(*index[d]) for d in rest)]
    if layout.transposed:
      part = self.tensors[name][tuple(hf_slices[::-1])].T
    else:
      part = self.tensors[name][tuple(hf_slices)]
    return part.reshape(view)[tuple(within)]


def _text_name(name: str) -> str:
  """A multimodal checkpoint's tensor of its text model by the text model's own name."""
  for prefix, text in TEXT_PREFIXES.items():
    if name.startswith(prefix):
      return text + name[len(prefix):]
  return name


def left_out(path: pathlib.Path) -> str | None:
  """What an import of `path` leaves out, in words (a multimodal model's other towers), or None."""
  with Checkpoint(path) as checkpoint:
    names = checkpoint.left_out
    if not names:
      return None
    count = sum(math.prod(shape) for shape in names.values())
  towers = sorted({name.split('.')[1 if name.startswith('model.') else 0] for name in names})
  return (f'{", ".join(towers)} ({len(names)} tensors, {count:,} parameters): meshlm trains and '
          'exports the text model alone')


def check_tensors(path: pathlib.Path, abstract_params, model_cfg) -> None:
  """Before data or memory are touched: `path` holds every tensor of this model (Checkpoint)."""
  with Checkpoint(path) as checkpoint:
    checkpoint.check_tensors(abstract_params, model_cfg)


def load_params(path: pathlib.Path, abstract_params, model_cfg):
  """The parameters of the checkpoint at `path` as `abstract_params` (ShapeDtypeStructs with
  shardings) has them: each device's part is read from the files on its own process, converted
  to the parameter's dtype, and placed, one tensor at a time, so no process ever holds the
  whole model."""
  with Checkpoint(path) as checkpoint:
    checkpoint.check_tensors(abstract_params, model_cfg)
    arrays = {}
    for key, leaf, layout, lead in _parameters(abstract_params, model_cfg):
      layers = np.arange(math.prod(leaf.shape[:lead])).reshape(leaf.shape[:lead])

      def part(index, leaf=leaf, layout=layout, lead=lead, layers=layers):
        index = [s.indices(n)[:2] for s, n in zip(index, leaf.shape)]
        rows = layers[tuple(slice(*i) for i in index[:lead])]
        experts = leaf.shape[lead - 1] if layout.experts else 1
        names = [layout.hf_name(i, experts) for i in rows.flat] if lead else [layout.name]
        parts = [checkpoint.read(name, layout, leaf.shape[lead:], index[lead:])
                 for name in names]
        return np.stack(parts).reshape(rows.shape + parts[0].shape).astype(leaf.dtype)

      arrays[key] = jax.make_array_from_callback(leaf.shape, leaf.sharding, part)
    return jax.tree_util.tree_map_with_path(lambda key, _: arrays[key], abstract_params)


def check_exportable(cfg) -> None:
  """ValueError naming the setting, for a model no checkpoint of FAMILIES can hold (a dense
  model, with q/k norms or without, is a Qwen3 or a Llama; with norms scaling by (1 + w), a
  Gemma 3, which has all of Gemma's settings)."""
  gemma = family(cfg) == 'gemma3_text'
  unlike = {  # a setting: whether this family's checkpoints cannot hold its value
      'norm_plus_one': cfg.norm_plus_one != gemma,
      'post_norms': cfg.post_norms != gemma, 'embed_scale': cfg.embed_scale != gemma,
      'mlp_activation': cfg.mlp_activation != ('gelu_tanh' if gemma else 'silu'),
      'qk_norm': gemma and not cfg.qk_norm,
      'query_scale': not gemma and cfg.query_scale not in (0, cfg.head_dim),
      'sliding_window': not gemma and cfg.sliding_window > 0,
      'rope_local_theta': not gemma and cfg.rope_local_theta > 0,
      'rope_type': (cfg.rope_type not in GEMMA3_ROPE) if gemma else cfg.rope_type == 'linear',
  }
  if bad := [field for field, is_bad in unlike.items() if is_bad]:
    raise ValueError(f'config.model.{bad[0]}={getattr(cfg, bad[0])!r}: a '
                     f'{"Gemma 3" if gemma else "Llama or Qwen3"} checkpoint cannot hold it (a '
                     'Gemma 3 has norm_plus_one, post_norms, embed_scale, qk_norm and '
                     "mlp_activation='gelu_tanh'; the others none of them)")
  if not cfg.experts:
    return
  unlike = {'router': cfg.router != 'softmax',
            'router_renormalize': not cfg.router_renormalize and family(cfg) == 'mixtral',
            'shared_experts': cfg.shared_experts, 'dense_layers': cfg.dense_layers,
            'rope_type': cfg.rope_type != 'default'}
  if bad := [field for field, is_bad in unlike.items() if is_bad]:
    raise ValueError(f'config.model.{bad[0]}={getattr(cfg, bad[0])!r}: the MoE checkpoints '
                     'meshlm exports (Mixtral, or Qwen3-MoE with qk_norm) have a softmax router '
                     "(Mixtral's renormalised), no shared experts, no dense layers and plain "
                     'RoPE')


def hf_config(cfg, tokenizer, seq_len: int, dtype: str) -> dict:
  """config.json for transformers' config of the model's family: LlamaConfig, Qwen3Config (q/k
  norms), Gemma3TextConfig (its RoPE by layer type, as transformers 5 writes it), MixtralConfig or
  Qwen3MoeConfig (experts); otherwise the form transformers 4 writes, which 5 reads."""
  rope_scaling = None
  if cfg.rope_type == 'llama3':
    rope_scaling = {'rope_type': 'llama3', 'factor': cfg.rope_factor,
                    'low_freq_factor': cfg.rope_low_freq_factor,
                    'high_freq_factor': cfg.rope_high_freq_factor,
                    'original_max_position_embeddings': cfg.rope_original_length}
  config = {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
      'vocab_size': cfg.vocab_size, 'hidden_size': cfg.d_model,
      'intermediate_size': cfg.d_ff, 'num_hidden_layers': cfg.n_layers,
      'num_attention_heads': cfg.n_heads, 'num_key_value_heads': cfg.n_kv_heads,
      'head_dim': cfg.head_dim, 'hidden_act': 'silu', 'rms_norm_eps': cfg.norm_eps,
      'rope_theta': cfg.rope_theta, 'rope_scaling': rope_scaling,
      # the context it was trained for: an imported model's, or longer if fine-tuned past it
      'max_position_embeddings': max(seq_len, cfg.max_position_embeddings or (
          int(cfg.rope_original_length * cfg.rope_factor) if rope_scaling else seq_len)),
      'tie_word_embeddings': cfg.tie_embeddings, 'attention_bias': False, 'mlp_bias': False,
      'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id,
      'pad_token_id': tokenizer.pad_id, 'torch_dtype': dtype, 'dtype': dtype,
      **{'qwen3': _qwen3_config, 'gemma3_text': _gemma3_config, 'mixtral': _mixtral_config,
         'qwen3_moe': _qwen3_moe_config}.get(
          family(cfg), lambda _: {})(cfg)}
  if family(cfg) == 'gemma3_text':  # Llama's names for what Gemma3TextConfig names otherwise
    for key in ('hidden_act', 'rope_theta', 'rope_scaling', 'mlp_bias'):
      config.pop(key)
  return config


def _qwen3_config(cfg) -> dict:
  return {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3',
          'use_sliding_window': False, 'sliding_window': None,
          'max_window_layers': cfg.n_layers, 'layer_types': ['full_attention'] * cfg.n_layers}


def _gemma3_config(cfg) -> dict:
  local, scalar = cfg.local_layers, cfg.query_scale or cfg.head_dim
  full = {'rope_type': cfg.rope_type, 'rope_theta': cfg.rope_theta,
          **({'factor': cfg.rope_factor} if cfg.rope_type == 'linear' else {})}
  return {'architectures': ['Gemma3ForCausalLM'], 'model_type': 'gemma3_text',
          'hidden_activation': 'gelu_pytorch_tanh',
          # an int where it is one: transformers 5's Gemma3TextConfig takes no float there
          'query_pre_attn_scalar': int(scalar) if float(scalar).is_integer() else scalar,
          'sliding_window': cfg.sliding_window or None,
          'layer_types': ['sliding_attention' if l else 'full_attention' for l in local],
          'rope_parameters': {'full_attention': full, 'sliding_attention': {
              'rope_type': 'default', 'rope_theta': cfg.rope_local_theta or cfg.rope_theta}},
          'final_logit_softcapping': None, 'attn_logit_softcapping': None,
          'use_bidirectional_attention': False}


def _mixtral_config(cfg) -> dict:
  return {'architectures': ['MixtralForCausalLM'], 'model_type': 'mixtral',
          'intermediate_size': cfg.expert_width, 'num_local_experts': cfg.experts,
          'num_experts_per_tok': cfg.experts_per_token, 'sliding_window': None,
          'router_aux_loss_coef': cfg.load_balance_loss / cfg.experts_per_token,
          'router_jitter_noise': 0.0, 'output_router_logits': False}


def _qwen3_moe_config(cfg) -> dict:
  return {'architectures': ['Qwen3MoeForCausalLM'], 'model_type': 'qwen3_moe',
          'moe_intermediate_size': cfg.expert_width, 'num_experts': cfg.experts,
          'num_local_experts': cfg.experts,  # transformers 5's name for it
          'num_experts_per_tok': cfg.experts_per_token, 'norm_topk_prob': cfg.router_renormalize,
          'decoder_sparse_step': 1, 'mlp_only_layers': [], 'use_sliding_window': False,
          'sliding_window': None,
          'router_aux_loss_coef': cfg.load_balance_loss / cfg.experts_per_token,
          'output_router_logits': False}


def _shards(tensors: list, max_bytes: int) -> list[list]:
  """`tensors` ((name, nbytes, read)) in order, cut into files of at most max_bytes each (a
  larger tensor alone in its file)."""
  shards, size = [[]], 0
  for tensor in tensors:
    if shards[-1] and size + tensor[1] > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(tensor)
    size += tensor[1]
  return shards


def export(params, cfg, tokenizer, seq_len: int, output: pathlib.Path, *, dtype: str,
           max_shard_bytes: int, chat_template: str | None = None, log=print) -> None:
  """Writes `params` (meshlm's, as arrays) as a checkpoint transformers loads: config.json,
  safetensors in HF's names and layout, in `dtype` (sharded with an index above max_shard_bytes),
  and the tokenizer's files where it has a HF form, with the run's `chat_template` (save_tokenizer).
  Built in a directory beside `output` and renamed to it at the end, so a failed export leaves no
  half checkpoint."""
  check_exportable(cfg)
  np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == 'bfloat16' else dtype)
  tensors = []  # (position, HF name, bytes, read): embed_tokens, each layer's, norm and head
  for _, leaf, layout, lead in _parameters(params, cfg):
    def read(leaf=leaf, layout=layout, at=(), name=layout.name):  # a layer (at) at a time
      return np.ascontiguousarray(cast(layout.to_hf(np.asarray(leaf[at])), np_dtype, name))

    nbytes = math.prod(leaf.shape[lead:]) * np_dtype.itemsize
    if not lead:
      position = -1 if layout == TENSORS['embed',] else math.inf
      tensors.append((position, layout.name, nbytes, read))
      continue
    for i, name in enumerate(_hf_names(layout, leaf, lead)):
      at = tuple(map(int, np.unravel_index(i, leaf.shape[:lead])))
      tensors.append((i, name, nbytes, functools.partial(read, at=at, name=name)))
  tensors = [t[1:] for t in sorted(tensors, key=lambda t: t[0])]  # stable: tree order within
  shards = _shards(tensors, max_shard_bytes)

  with written_whole(output) as partial:
    weight_map = {}
    for n, shard in enumerate(shards, 1):
      file = ('model.safetensors' if len(shards) == 1 else
              f'model-{n:05d}-of-{len(shards):05d}.safetensors')
      save_file({name: read() for name, _, read in shard}, partial / file,
                metadata={'format': 'pt'})
      weight_map.update({name: file for name, _, _ in shard})
      log(f'wrote {file} ({sum(t[1] for t in shard) / 2**20:,.1f} MiB)')
    if len(shards) > 1:
      (partial / 'model.safetensors.index.json').write_text(json.dumps(
          {'metadata': {'total_size': sum(t[1] for t in tensors)}, 'weight_map': weight_map},
          indent=2) + '\n')
    (partial / 'config.json').write_text(
        json.dumps(hf_config(cfg, tokenizer, seq_len, dtype), indent=2) + '\n')
    save_tokenizer(tokenizer, partial, chat_template, log)


def save_tokenizer(tokenizer, directory: pathlib.Path, chat_template: str | None = None,
                   log=print) -> None:
  """The tokenizer's files where it has a HF form, carrying `chat_template` (the one a run
  rendered its records with) as transformers reads it: in tokenizer_config.json and as
  chat_template.jinja, which transformers prefers, so apply_chat_template formats prompts as
  the run was trained."""
  if not hasattr(tokenizer, 'save_hf'):
    log(f'the {tokenizer.name} tokenizer has no Hugging Face form here: pass its model file '
        'along with the checkpoint')
    return
  tokenizer.save_hf(directory)
  if chat_template is not None:
    config = directory / 'tokenizer_config.json'
    settings = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps({**settings, 'chat_template': chat_template}, indent=2) + '\n')
    (directory / 'chat_template.jinja').write_text(chat_template)


def cast(x: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
  """`x` in `dtype`; ValueError naming the tensor if a value is past the dtype's range (float16's
  65504): the cast would write inf where the model has a weight."""
  with np.errstate(over='ignore'):  # found below, and named
    out = x.astype(dtype)
  if not np.all(np.isfinite(out)) and np.all(np.isfinite(x)):
    largest = float(np.max(np.abs(x.astype(np.float64))))
    raise ValueError(f'--dtype={dtype.name}: tensor {name} holds {largest:.6g}, past the largest '
                     f'{dtype.name} ({float(np.finfo(dtype).max):.6g}), which would be written as '
                     'inf; export in bfloat16 or float32')
  return out


@contextlib.contextmanager
def written_whole(output: pathlib.Path):
  """A directory beside `output` to write an export into, renamed to `output` when the block
  ends, with the modes any file the user writes has; a failure removes it, and a full or
  read-only disk is a Fault naming --output. `output` is new or empty (check_output)."""
  output.parent.mkdir(parents=True, exist_ok=True)
  _clear_stale_partials(output)
  partial = pathlib.Path(tempfile.mkdtemp(prefix=_partial_prefix(output) + f'{os.getpid()}-',
                                          dir=output.parent))
  try:
    yield partial
    if output.exists():
      output.rmdir()  # empty (checked before the export started); never replaced if not
    umask = os.umask(0o022)
    os.umask(umask)
    for file in partial.iterdir():  # as any file the user writes (safetensors makes it private)
      file.chmod(0o666 & ~umask)
    partial.chmod(0o777 & ~umask)  # mkdtemp makes it private
    partial.rename(output)
  except BaseException as e:
    shutil.rmtree(partial, ignore_errors=True)
    if fault := faults.on_disk(e, where=f'--output={output}'):
      raise faults.Fault(f'{fault}; nothing was written there') from None
    raise


def _partial_prefix(output: pathlib.Path) -> str:
  return f'.{output.name}.partial-{socket.gethostname()}-'


def _clear_stale_partials(output: pathlib.Path) -> None:
  """Removes what an export to `output` killed on this host (SIGKILL, a lost node) left beside
  it: partial directories whose process is gone. Never another host's: its process may live."""
  prefix = _partial_prefix(output)
  for partial in output.parent.glob(f'{glob.escape(prefix)}*'):
    pid = partial.name[len(prefix):].split('-')[0]
    if pid.isdigit() and not _alive(int(pid)):
      shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's
    return True
  return True


def check_output(output: pathlib.Path) -> None:
  """ValueError unless --output is new or an empty directory: an export never overwrites."""
  if file := next((p for p in output.parents if p.exists() and not p.is_dir()), None):
    raise ValueError(f'--output={output}: {file} is a file, not a directory; give a new '
                     'directory to write the export into')
  if output.exists() and (not output.is_dir() or any(output.iterdir())):
    raise ValueError(f'--output={output} exists and is not an empty directory; an export never '
                     'overwrites: pick a new directory')
