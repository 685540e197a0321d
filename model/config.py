"""The model's settings as a plain dataclass: the boundary between configs/ and model/."""

import dataclasses

import jax.numpy as jnp

from kernels.attention import IMPLEMENTATIONS, OURS, hopper_refuses
from kernels.flash_attention import hopper_blocks
from kernels.grouped_matmul import IMPLEMENTATIONS as EXPERT_MATMULS

REMAT_POLICIES = ('none', 'full', 'dots', 'dots_attention', 'dots_except_out',
                  'dots_attention_except_out', 'save_qkv_proj', 'save_attention', 'offload_dots',
                  'offload_qkv_proj', 'offload_attention')
# Those that keep the `dots` set plus an attention kernel's output and statistics: with no kernel
# (attention='xla') they are refused by name, and each has its `dots` twin (drop '_attention').
KEEPS_KERNEL = ('dots_attention', 'dots_attention_except_out')
DTYPES = ('float32', 'bfloat16', 'float16')
CONTEXT_PARALLEL = ('all_gather', 'ring')  # kernels/context_parallel.py
ROPE_TYPES = ('default', 'llama3')  # transformers' names: plain RoPE, Llama 3.1's rescaling
MATMUL_PRECISIONS = ('default', 'fp8')  # projections on compute-dtype or scaled fp8 operands
ROUTERS = ('softmax', 'sigmoid')  # model/moe.py: Mixtral's and Qwen's; DeepSeek-V3's
LORA_TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')  # the projections adapters may adapt
DRAFT_KINDS = ('clover', 'medusa')  # model/draft.py


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float
  rope_type: str
  rope_factor: float
  rope_low_freq_factor: float
  rope_high_freq_factor: float
  rope_original_length: int
  max_position_embeddings: int  # the context an export declares (the model itself reads no limit)
  norm_eps: float
  qk_norm: bool  # queries and keys RMS-normalised per head before RoPE (Qwen3, OLMoE)
  tie_embeddings: bool
  param_dtype: str
  compute_dtype: str
  grad_reduce_dtype: str
  matmul_precision: str
  attention: str
  attention_block_q: int
  attention_block_k: int
  cudnn_segments: int  # cuDNN: the most documents a packed row holds for its packed layout; 0: mask
  context_parallel: str
  scan_layers: bool
  remat_policy: str
  virtual_stages: int
  head_chunk: int  # tokens a device's head and loss take at once (model/head.py); 0: all
  prefetch_weights: bool  # FSDP's weight gathers a layer early (training/programs.py)
  scheduler_memory: float  # GPUs: what XLA's scheduler may plan to fill (training/programs.py)
  # Mixture of experts (model/moe.py); experts = 0: every layer's MLP is dense.
  experts: int
  experts_per_token: int
  shared_experts: int  # always-on experts, one SwiGLU of shared_experts × expert_d_ff
  expert_d_ff: int  # 0: d_ff
  dense_layers: int  # the first this many layers keep a dense MLP of width d_ff
  router: str
  router_renormalize: bool  # the chosen experts' weights rescaled to sum to 1
  router_bias_rate: float  # sigmoid router: the aux-loss-free balancing bias's step per step
  capacity_factor: float  # 0: dropless; else each expert takes at most this × its fair share
  expert_buffer: float  # with an expert axis, 0: room for the worst case; else this × the average
  load_balance_loss: float  # weight of the load-balancing loss (1 when perfectly balanced)
  router_z_loss: float  # weight of the router's mean log(Z)²
  expert_matmul: str  # kernels/grouped_matmul.py: pallas (ours) | ragged_dot | dense
  # Low-rank adapters (model/layers.py: Adapter); lora_rank = 0: none, every parameter trains.
  lora_rank: int  # r: W x + (lora_alpha / r) · B A x on each target projection, the rest frozen
  lora_alpha: float
  lora_targets: str  # comma-separated, of LORA_TARGETS
  # Draft heads for speculative decoding (model/draft.py); draft_heads = 0: none.
  draft_heads: int  # K: head k guesses the token k+1 after the one the base predicts from
  draft_kind: str  # of DRAFT_KINDS
  draft_only: bool  # only the heads train; the base is frozen

  def __post_init__(self):
    if self.vocab_size == 0:
      raise ValueError('config.model.vocab_size=0 means "follow the tokenizer" and must be resolved '
                       'first: training.settings.resolve(config) does')
    for name in ('vocab_size', 'd_model', 'n_layers', 'n_heads', 'n_kv_heads', 'head_dim', 'd_ff',
                 'virtual_stages'):
      if getattr(self, name) < 1:
        raise ValueError(f'config.model.{name} must be a positive integer, got {getattr(self, name)}')
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f'config.model.n_heads ({self.n_heads}) must be a multiple of config.model.n_kv_heads '
          f'({self.n_kv_heads}) for grouped-query attention; pick n_kv_heads dividing n_heads')
    if self.n_layers % self.virtual_stages:
      raise ValueError(f'config.model.n_layers={self.n_layers} is not divisible by '
                       f'config.model.virtual_stages={self.virtual_stages}; the layers are '
                       'stacked as that many equal chunks')
    if self.head_dim % 2:
      raise ValueError(f'config.model.head_dim ({self.head_dim}) must be even for rotary embeddings')
    _check_choice('rope_type', self.rope_type, ROPE_TYPES)
    if self.rope_type == 'llama3' and not (
        self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        and self.rope_original_length > 0):
      raise ValueError(
          "config.model.rope_type='llama3' needs rope_factor >= 1, 0 < rope_low_freq_factor < "
          f'rope_high_freq_factor and rope_original_length > 0; got {self.rope_factor}, '
          f'{self.rope_low_freq_factor}, {self.rope_high_freq_factor}, '
          f'{self.rope_original_length}')
    # 'auto' is made concrete for the devices before a model is built (training/settings.py)
    _check_choice('attention', self.attention, ('auto', *IMPLEMENTATIONS))
    if not 0 <= self.cudnn_segments <= 1024:
      raise ValueError(f'config.model.cudnn_segments={self.cudnn_segments} must be 0 (cuDNN takes '
                       'packed rows as a dense document mask) to 1024 (the most documents a row '
                       'may hold for its packed layout; docs/attention.md)')
    if self.head_chunk < 0:
      raise ValueError(f'config.model.head_chunk={self.head_chunk} must be 0 (the whole batch\'s '
                       'logits at once) or a number of tokens, such as 4096')
    for name in ('attention_block_q', 'attention_block_k'):
      block = getattr(self, name)
      if block < 0 or block & (block - 1):
        raise ValueError(f'config.model.{name}={block} must be 0 (the default for the device) or '
                         'a power of two such as 64 or 128')
    if self.attention == 'hopper':
      if why := hopper_refuses(self.head_dim, self.compute_dtype):
        raise ValueError(f"config.model.attention='hopper' cannot run {why}; use "
                         '--config.model.attention=pallas (ours in Triton) or auto')
      if self.attention_block_q not in (0, 64) or self.attention_block_k not in (0, 64, 128, 256):
        raise ValueError(f"config.model.attention='hopper' takes attention_block_q 0 or 64 (one "
                         f"warpgroup's rows; it is {self.attention_block_q}) and "
                         f'attention_block_k 0, 64, 128 or 256 (it is {self.attention_block_k})')
    _check_choice('context_parallel', self.context_parallel, CONTEXT_PARALLEL)
    if self.context_parallel == 'ring' and self.attention not in ('auto', *OURS):
      raise ValueError(f"config.model.context_parallel='ring' runs our Pallas kernel on each visiting "
                       f"chunk; set --config.model.attention=pallas (it is "
                       f"{self.attention!r}), or context_parallel='all_gather'")
    _check_choice('remat_policy', self.remat_policy, REMAT_POLICIES)
    _check_choice('param_dtype', self.param_dtype, DTYPES)
    _check_choice('compute_dtype', self.compute_dtype, DTYPES)
    _check_choice('grad_reduce_dtype', self.grad_reduce_dtype, ('auto',) + DTYPES)
    if self.grad_reduce_dtype not in ('auto', 'float32', self.compute_dtype):
      # A weight reaches its matmul through a copy in the reduction dtype (model/layers.py:
      # weight), whose gradient is what crosses devices: a narrower one rounds the forward too.
      raise ValueError(f'config.model.grad_reduce_dtype={self.grad_reduce_dtype!r} with '
                       f'compute_dtype={self.compute_dtype!r}: each weight reaches its matmul '
                       f'as a {self.grad_reduce_dtype} copy, so the forward would run on rounded '
                       "weights; reduce in 'float32', or compute in "
                       f'{self.grad_reduce_dtype!r}')
    _check_choice('matmul_precision', self.matmul_precision, MATMUL_PRECISIONS)
    if self.experts:
      self._check_experts()
    if self.lora_rank:
      self._check_lora()
    self._check_draft()

  def _check_lora(self):
    if self.lora_rank < 0:
      raise ValueError(f'config.model.lora_rank={self.lora_rank} must be 0 (no adapters) or more')
    if not self.lora_alpha > 0:
      raise ValueError(f'config.model.lora_alpha={self.lora_alpha} must be positive')
    if not self.lora_target_names or set(self.lora_target_names) - set(LORA_TARGETS):
      raise ValueError(f'config.model.lora_targets={self.lora_targets!r} must name some of '
                       f'{",".join(LORA_TARGETS)}, comma-separated')
    if self.experts:
      raise ValueError('config.model.lora_rank > 0 adapts dense models only: an MoE\'s experts '
                       'have no adapters yet; set lora_rank=0 or experts=0')
    if self.matmul_precision == 'fp8':
      raise ValueError("config.model.lora_rank > 0 keeps the base in the compute dtype; use "
                       "--config.model.matmul_precision=default with it")
    attention, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    sides = {'q': (self.d_model, attention), 'k': (self.d_model, kv), 'v': (self.d_model, kv),
             'o': (attention, self.d_model), 'gate': (self.d_model, self.d_ff),
             'up': (self.d_model, self.d_ff), 'down': (self.d_ff, self.d_model)}
    target, width = min(((t, min(sides[t])) for t in self.lora_target_names), key=lambda x: x[1])
    if self.lora_rank > width:
      raise ValueError(f'config.model.lora_rank={self.lora_rank} is more than the {width} a '
                       f'side of the {target!r} projection it adapts: an adapter of higher rank '
                       f'holds nothing a rank-{width} one does not; give at most {width}')

  def _check_draft(self):
    if self.draft_heads < 0:
      raise ValueError(f'config.model.draft_heads={self.draft_heads} must be 0 (none) or more')
    _check_choice('draft_kind', self.draft_kind, DRAFT_KINDS)
    if self.draft_only and not self.draft_heads:
      raise ValueError('config.model.draft_only=True trains the draft heads alone, and '
                       'config.model.draft_heads is 0; set it to the heads wanted, e.g. 3')
    if self.draft_only and self.lora_rank:
      raise ValueError('config.model.draft_only=True freezes everything but the draft heads, '
                       'adapters too; set lora_rank=0 or draft_only=False')

  def _check_experts(self):
    if self.experts < 2:
      raise ValueError(f'config.model.experts={self.experts} must be 0 (dense) or at least 2')
    if not 1 <= self.experts_per_token <= self.experts:
      raise ValueError(f'config.model.experts_per_token={self.experts_per_token} must be between '
                       f'1 and config.model.experts={self.experts}')
    for name in ('shared_experts', 'expert_d_ff', 'dense_layers'):
      if getattr(self, name) < 0:
        raise ValueError(f'config.model.{name}={getattr(self, name)} must be 0 or more')
    if self.dense_layers >= self.n_layers:
      raise ValueError(f'config.model.dense_layers={self.dense_layers} leaves no MoE layer of '
                       f'config.model.n_layers={self.n_layers}; set experts=0 for a dense model')
    if self.dense_layers and self.virtual_stages > 1:
      raise ValueError('config.model.dense_layers > 0 cannot be split into pipeline chunks '
                       '(config.model.virtual_stages > 1) yet: set one of them to its default')
    if (self.n_layers - self.dense_layers) % self.virtual_stages:
      raise ValueError(f'config.model.n_layers - dense_layers = '
                       f'{self.n_layers - self.dense_layers} is not divisible by '
                       f'config.model.virtual_stages={self.virtual_stages}')
    _check_choice('router', self.router, ROUTERS)
    _check_choice('expert_matmul', self.expert_matmul, EXPERT_MATMULS)
    if self.router_bias_rate < 0 or (self.router_bias_rate and self.router != 'sigmoid'):
      raise ValueError(f'config.model.router_bias_rate={self.router_bias_rate} must be 0, or '
                       "positive with config.model.router='sigmoid' (DeepSeek-V3's "
                       'aux-loss-free balancing, e.g. 0.001)')
    for name in ('capacity_factor', 'expert_buffer', 'load_balance_loss', 'router_z_loss'):
      if not getattr(self, name) >= 0:
        raise ValueError(f'config.model.{name}={getattr(self, name)} must be 0 or more')
    if (self.d_model % 16 or self.expert_width % 16) and self.expert_matmul == 'pallas':
      raise ValueError(f'config.model.d_model={self.d_model} and the expert width '
                       f'{self.expert_width} must be multiples of 16 for the grouped-matmul '
                       "kernel; change them, or set config.model.expert_matmul='ragged_dot'")
    if self.matmul_precision == 'fp8':
      raise ValueError("config.model.matmul_precision='fp8' has no form for the experts' grouped "
                       'GEMMs yet; use --config.model.matmul_precision=default with experts > 0')

  @classmethod
  def from_config(cls, model_config) -> 'ModelConfig':
    """From `config.model` (an ml_collections ConfigDict or any mapping)."""
    fields = dict(model_config)
    known = {f.name for f in dataclasses.fields(cls)}
    if unknown := set(fields) - known:
      raise ValueError(f'config.model has unknown fields {sorted(unknown)}; known: {sorted(known)}')
    if missing := known - set(fields):
      raise ValueError(f'config.model lacks fields {sorted(missing)}; add them to configs/base.py')
    return cls(**fields)

  def dropless(self) -> 'ModelConfig':
    """This model with every token routed (no capacity or buffer drops): what sampling and
    evaluation compute, so no token's output depends on the others in its batch."""
    return dataclasses.replace(self, capacity_factor=0.0, expert_buffer=0.0)

  @property
  def expert_width(self) -> int:
    return self.expert_d_ff or self.d_ff

  @property
  def moe_layers(self) -> int:
    """How many layers have experts (the last n_layers - dense_layers), 0 for a dense model."""
    return self.n_layers - self.dense_layers if self.experts else 0

  @property
  def dtype(self):
    return jnp.dtype(self.compute_dtype)

  @property
  def length_tile(self) -> int:
    """Positions that each call of the attention kernel must take in whole blocks of: the
    Hopper kernel's key block (it masks no padding; kernels/flash_attention.py pads for the
    others), 1 for every other implementation."""
    if self.attention != 'hopper':
      return 1
    return max(64, self.attention_block_k or hopper_blocks(self.head_dim)[1])

  @property
  def reduce_dtype(self):
    """What gradients are summed across devices in: grad_reduce_dtype. A resolved run's is a
    dtype (training/settings.py: with_reduce_dtype decides 'auto'); an unresolved 'auto' is
    taken as the compute dtype, its value on GPUs (docs/precision.md)."""
    return jnp.dtype(self.compute_dtype if self.grad_reduce_dtype == 'auto'
                     else self.grad_reduce_dtype)

  @property
  def weight_dtype(self):
    """The base parameters': param_dtype, or, frozen under adapters, the compute dtype."""
    return jnp.dtype(self.compute_dtype if self.lora_rank else self.param_dtype)

  @property
  def lora_target_names(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.lora_targets.split(',') if t.strip())

  @property
  def frozen_base(self) -> bool:
    """Whether the base's parameters are frozen: under LoRA, or training draft heads alone."""
    return bool(self.lora_rank or self.draft_only)

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank


def _check_choice(field, value, choices):
  if value not in choices:
    raise ValueError(f'config.model.{field}={value!r} is not one of {choices}')
