"""Every setting meshlm reads, declared once: a field of its section's frozen dataclass with its
default, what it does, its effect on a run (configs/effects.py), the values it may take and its
Hugging Face name (configs/schema.py). The config every other config starts from is derived
from them (`get_config`), and so are `EFFECTS`, the checks, and docs/settings.md's table.

Run (a tiny model for a few steps, a smoke test of the whole stack):
  python train.py --config=configs/base.py --config.workdir=/tmp/meshlm-base
Should reach: loss 2.41 and eval loss 2.78 (4.01 bits/byte; from 6.25 at step 1, ln(384) ≈ 5.95
being a uniform guess) after its 100 steps, in about 15 seconds on a 2-core CPU. Every step's loss
is in tests/data/curves/base.json (scripts/loss_curves.py), which a test holds a fresh run to.
"""

import dataclasses
import pathlib
import typing

import ml_collections

from configs.schema import (POSITIVE, SHARE, Section, at_least, between, config_dict, section,
                            sections, setting)
from configs import schema

# The values some settings choose among; the modules that act on them import these.
DTYPES = ('float32', 'bfloat16', 'float16')
ROPE_TYPES = ('default', 'llama3', 'linear')  # transformers' names: plain RoPE, Llama 3.1's
# rescaling, positions divided by rope_factor (Gemma 3's global layers)
MLP_ACTIVATIONS = ('silu', 'gelu_tanh')  # the gated MLP's: SwiGLU, GeGLU (Gemma's)
ATTENTION_KERNELS = ('xla', 'cudnn', 'pallas', 'hopper')  # kernels/attention.py
OUR_ATTENTION = ('pallas', 'hopper')  # ours: Triton, and Mosaic GPU for sm_90a
CONTEXT_PARALLEL = ('all_gather', 'ring')  # kernels/context_parallel.py
REMAT_POLICIES = ('none', 'full', 'dots', 'dots_attention', 'dots_except_out',
                  'dots_attention_except_out', 'save_qkv_proj', 'save_attention', 'offload_dots',
                  'offload_qkv_proj', 'offload_attention')
# Those that keep the `dots` set plus an attention kernel's output and statistics: with no kernel
# (attention='xla') they are refused by name, and each has its `dots` twin (drop '_attention').
KEEPS_KERNEL = ('dots_attention', 'dots_attention_except_out')
MATMUL_PRECISIONS = ('default', 'fp8')  # projections on compute-dtype or scaled fp8 operands
ROUTERS = ('softmax', 'sigmoid')  # model/moe.py: Mixtral's and Qwen's; DeepSeek-V3's
EXPERT_MATMULS = ('pallas', 'ragged_dot', 'dense')  # kernels/grouped_matmul.py
LORA_TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')  # the projections adapters may adapt
DRAFT_KINDS = ('clover', 'medusa')  # model/draft.py
SCHEMES = ('exact', 'int8')  # what crosses config.mesh.data (sharding/hierarchical.py)
SCHEDULES = ('cosine', 'wsd')  # training/optimizer.py: make_schedule
OPTIMIZERS = ('adamw', 'muon')  # training/optimizer.py: make_optimizer
MUON_LAYOUTS = ('round_robin', 'as_params')  # training/optimizer.py: orthogonalised
MAX_LOGIT = 'attention_max_logit'  # QK-clip's measure (qk_clip) among a step's statistics
NEWTON_SCHULZ = 'muon_newton_schulz'  # the name scope of Muon's iterations in a compiled step
DECAY_SHAPES = ('linear', 'sqrt')  # wsd's decay: linear, or 1 − √progress
RECORDS = ('text', 'prompt_completion', 'messages', 'preference', 'chat_preference')
PREFERENCE_RECORDS = ('preference', 'chat_preference')  # pairs, trained on by DPO
TRAIN_ON = ('answers', 'all')
TOKENIZERS = ('byte', 'sentencepiece', 'hf')
TOKENIZE = ('auto', 'once', 'on_the_fly')
INIT_ADAPTERS = ('merge', 'leave')
DEVICE, HOST, NVME = 'device', 'host', 'nvme'  # where the optimizer's state may live
TIERED = ('master_tier', 'mu_tier', 'nu_tier')  # the settings that place it
HF, RUN = 'hf', 'run'  # Start.kind: a Hugging Face checkpoint, a meshlm run's
RANDOM = 'random'  # config.init_from: freshly drawn parameters, on purpose

POWER_OF_TWO = (lambda block: block >= 0 and not block & (block - 1),
                '0 (the default for the device) or a power of two such as 64 or 128')


def _dtype(name: str):
  # jax loads only when a dtype is asked for: a config and its checks need no jax
  # (train.py refuses a bad setting before jax, flax and the data stack are imported).
  import jax.numpy as jnp
  return jnp.dtype(name)


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
  """The transformer: its shapes, what it computes, how, and what is added to it."""
  SECTION: typing.ClassVar[str] = 'model'
  vocab_size: int = setting(0, "the embedding's rows; 0: the tokenizer's size padded to a "
                            'multiple of 128 (byte: 259 → 384)', 'shape', range=at_least(0),
                            hf='vocab_size')
  d_model: int = setting(64, 'the width of the residual stream', 'shape', range=at_least(1),
                         hf='hidden_size')
  n_layers: int = setting(2, 'transformer blocks', 'shape', range=at_least(1),
                          hf='num_hidden_layers')
  n_heads: int = setting(4, 'query heads', 'shape', range=at_least(1), hf='num_attention_heads')
  n_kv_heads: int = setting(2, 'key/value heads (grouped-query attention: n_heads a multiple)',
                            'shape', range=at_least(1), hf='num_key_value_heads')
  head_dim: int = setting(16, "each head's width (even: rotary embeddings)", 'shape',
                          range=at_least(1), hf='head_dim')
  d_ff: int = setting(192, "the SwiGLU MLP's width", 'shape', range=at_least(1),
                      hf='intermediate_size')
  rope_theta: float = setting(10_000.0, "RoPE's base", 'function', range=POSITIVE,
                              hf='rope_theta')
  rope_type: str = setting('default', "default | llama3: Llama 3.1's frequency rescaling, with "
                           'the four below | linear: every frequency divided by rope_factor',
                           'function', choices=ROPE_TYPES, hf='rope_type')
  rope_factor: float = setting(8.0, 'llama3: low frequencies are divided by this; linear: all',
                               'function', range=POSITIVE, hf='factor')
  rope_low_freq_factor: float = setting(1.0, 'llama3: wavelengths above original_length / this '
                                        'are low frequencies', 'function', range=POSITIVE,
                                        hf='low_freq_factor')
  rope_high_freq_factor: float = setting(4.0, 'llama3: below original_length / this, high: '
                                         'kept; between, blended', 'function', range=POSITIVE,
                                         hf='high_freq_factor')
  rope_original_length: int = setting(8192, 'llama3: the context the frequencies were trained '
                                      'for', 'function', range=at_least(1),
                                      hf='original_max_position_embeddings')
  max_position_embeddings: int = setting(0, "the context an export declares (hf:DIR's); 0: "
                                         "max(seq_len, rope's); the model itself reads no limit",
                                         'function', range=at_least(0),
                                         hf='max_position_embeddings')
  norm_eps: float = setting(1e-5, "RMSNorm's epsilon", 'function', range=POSITIVE,
                            hf='rms_norm_eps')
  qk_norm: bool = setting(False, "queries and keys RMS-normalised per head before RoPE (Qwen3's, "
                          "OLMoE's)", 'shape')
  norm_plus_one: bool = setting(False, 'every RMSNorm multiplies by (1 + its scale), the scale '
                                "starting at 0 (Gemma's)", 'function')
  post_norms: bool = setting(False, "an RMSNorm on attention's and the MLP's outputs too, before "
                             "each residual add (Gemma 2 and 3's)", 'shape')
  mlp_activation: str = setting('silu', "the gated MLP's: silu (SwiGLU) | gelu_tanh (GeGLU with "
                                "tanh-approximated GELU, Gemma's)", 'function',
                                choices=MLP_ACTIVATIONS)
  embed_scale: bool = setting(False, "the embedding's rows enter the blocks multiplied by "
                              "√d_model (Gemma's; a tied head's table is not)", 'function')
  query_scale: float = setting(0.0, "attention's scores are scaled by 1/√this (Gemma's "
                               'query_pre_attn_scalar); 0: 1/√head_dim', 'function',
                               range=at_least(0))
  sliding_window: int = setting(0, 'local layers attend to the last this many positions, their '
                                'own included; 0: no layer is local', 'function',
                                range=at_least(0))
  global_every: int = setting(0, 'with sliding_window: layer i attends globally when (i + 1) % '
                              "this == 0, the others are local (Gemma 3's 6); 0: every layer "
                              'local', 'function', range=at_least(0))
  qk_clip: float = setting(0.0, "QK-clip's τ (MuonClip, Kimi K2's 100): after each update, "
                           "every head whose largest attention logit this step (its queries' "
                           'largest log-sum-exp, which bounds it) exceeded τ has its query and '
                           'key weights scaled so that it would have been τ; 0: off', 'schedule',
                           range=at_least(0))
  rope_local_theta: float = setting(0.0, "local layers' RoPE base, unscaled (Gemma 3's 10,000); "
                                    "0: the global layers' (rope_theta, rope_type)", 'function',
                                    range=at_least(0))
  tie_embeddings: bool = setting(False, 'the head is the embedding table', 'shape',
                                 hf='tie_word_embeddings')
  param_dtype: str = setting('float32', 'what the trained parameters are kept in', 'numerics',
                             choices=DTYPES)
  compute_dtype: str = setting('bfloat16', 'what the layers compute in', 'numerics',
                               choices=DTYPES)
  grad_reduce_dtype: str = setting('auto', 'gradients are summed across devices in this; auto: '
                                   'the compute dtype on several GPUs, float32 on one and on '
                                   'CPUs (docs/precision.md)', 'numerics',
                                   choices=('auto',) + DTYPES)
  matmul_precision: str = setting('default', "default | fp8: the layers' projections on scaled "
                                  'fp8 (docs/precision.md)', 'numerics',
                                  choices=MATMUL_PRECISIONS)
  attention: str = setting('auto', 'auto | xla | cudnn | pallas (ours) | hopper (ours for '
                           'sm_90a); auto: xla on CPU, on GPU the fused one the time model '
                           'predicts fastest (docs/attention.md)', 'numerics',
                           choices=('auto',) + ATTENTION_KERNELS)
  attention_block_q: int = setting(0, "our kernels' query tile rows; 0: a default for the "
                                   'head_dim', 'numerics', range=POWER_OF_TWO)
  attention_block_k: int = setting(0, "our kernels' key tile rows; 0: a default for the "
                                   'head_dim', 'numerics', range=POWER_OF_TWO)
  cudnn_segments: int = setting(16, 'cuDNN: a batch whose packed rows hold at most this many '
                                'documents attends within each, skipping the blocks between; a '
                                'fuller row takes the dense document mask that step '
                                '(docs/attention.md); 0: always the mask', 'numerics',
                                range=between(0, 1024))
  context_parallel: str = setting('all_gather', 'all_gather | ring: attention over a sequence '
                                  'split (docs/parallelism.md)', 'numerics',
                                  choices=CONTEXT_PARALLEL)
  scan_layers: bool = setting(True, 'False unrolls the layer scan (same parameters, longer '
                              'compile)', 'numerics')
  remat_policy: str = setting('none', 'what the backward recomputes rather than keeps '
                              '(docs/memory.md)', 'numerics', choices=REMAT_POLICIES)
  virtual_stages: int = setting(1, 'pipeline chunks per stage, interleaved '
                                '(docs/parallelism.md); shapes the parameters', 'shape',
                                range=at_least(1))
  prefetch_weights: bool = setting(False, "start each layer's weight all-gathers in the layer "
                                   "before (XLA's collective pipeliner; one more layer's weights "
                                   'held): where they cross nodes (docs/parallelism.md)',
                                   'numerics')
  scheduler_memory: float = setting(0.95, "GPUs: the share of the memory beside a step's inputs "
                                    "and outputs that XLA's scheduler may plan to fill while it "
                                    "overlaps communication with compute (XLA's own is 0.95); "
                                    "above 1 where a microbatch loop's gradient sums are most of "
                                    'the memory (docs/memory.md)', 'numerics',
                                    range=(lambda value: 0 < value <= 10, 'in (0, 10]'))
  head_chunk: int = setting(4096, "tokens a device's head and loss take at once: logits never "
                            'whole (docs/memory.md); 0: all', 'numerics', range=at_least(0))
  experts: int = setting(0, 'routed SwiGLU experts per MoE layer (docs/moe.md); 0: a dense model',
                         'shape', range=at_least(0))
  experts_per_token: int = setting(2, 'top-k: the experts each token goes through', 'function',
                                   range=at_least(1))
  shared_experts: int = setting(0, "experts every token also goes through (DeepSeek's), one "
                                'SwiGLU of shared_experts × expert_d_ff', 'shape',
                                range=at_least(0))
  expert_d_ff: int = setting(0, "each expert's width; 0: d_ff", 'shape', range=at_least(0))
  dense_layers: int = setting(0, "the first this many layers keep a dense MLP (DeepSeek's first "
                              'k)', 'shape', range=at_least(0))
  router: str = setting('softmax', 'softmax: top-k of the softmax (Mixtral, Qwen) | sigmoid '
                        '(DeepSeek-V3)', 'function', choices=ROUTERS)
  router_renormalize: bool = setting(True, "the chosen experts' weights rescaled to sum to 1",
                                     'function')
  router_bias_rate: float = setting(0.0, "sigmoid: the aux-loss-free balancing bias's step "
                                    '(DeepSeek-V3: 0.001)', 'schedule', range=at_least(0))
  capacity_factor: float = setting(0.0, 'an expert takes at most this × its fair share of the '
                                   'tokens; 0: dropless', 'function', range=at_least(0))
  expert_buffer: float = setting(0.0, "with config.mesh.expert > 1, the rows a device's experts "
                                 'can take in: 0, the worst case (nothing dropped); f, f × what '
                                 'it takes when balanced, the excess dropped and counted in '
                                 'moe_dropped (docs/moe.md)', 'function', range=at_least(0))
  load_balance_loss: float = setting(0.01, 'weight of the load-balancing loss (1.0 when '
                                     'balanced)', 'schedule', range=at_least(0))
  router_z_loss: float = setting(0.001, "weight of the router's mean log(Z)²", 'schedule',
                                 range=at_least(0))
  expert_matmul: str = setting('pallas', 'pallas (ours; interpret mode off GPU) | ragged_dot | '
                               'dense', 'numerics', choices=EXPERT_MATMULS)
  lora_rank: int = setting(0, 'r: LoRA adapters on lora_targets, trained alone, the base frozen '
                           'in compute_dtype (docs/fine-tuning.md); 0: every parameter trains',
                           'added', range=at_least(0))
  lora_alpha: float = setting(16.0, "the adapters' output is scaled by alpha / r (PEFT's "
                              'lora_alpha)', 'added', range=POSITIVE)
  lora_targets: str = setting('q,k,v,o,gate,up,down', 'the projections adapted, of q, k, v, o '
                              '(attention), gate, up, down (MLP)', 'added')
  draft_heads: int = setting(0, "K small heads that guess the K tokens after the next, for "
                             "sample.py's speculative decoding (docs/sampling.md); they never "
                             'change the base; 0: none', 'added', range=at_least(0))
  draft_kind: str = setting('clover', 'clover: each head sees the token the one before guessed '
                            '| medusa', 'added', choices=DRAFT_KINDS)
  draft_only: bool = setting(False, 'only the heads train, the base frozen (start it with '
                             'config.init_from)', 'added')

  def check(self):
    if self.vocab_size == 0:
      raise ValueError('config.model.vocab_size=0 means "follow the tokenizer" and must be resolved '
                       'first: training.settings.resolve(config) does')
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
    if self.rope_type == 'llama3' and not (
        self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
      raise ValueError(
          "config.model.rope_type='llama3' needs rope_factor >= 1 and 0 < rope_low_freq_factor < "
          f'rope_high_freq_factor; got {self.rope_factor}, {self.rope_low_freq_factor}, '
          f'{self.rope_high_freq_factor}')
    if self.rope_type == 'linear' and self.rope_factor < 1:
      raise ValueError(f"config.model.rope_type='linear' divides positions by rope_factor, which "
                       f'must be at least 1 (it is {self.rope_factor})')
    if self.sliding_window:
      self._check_windows()
    if self.attention == 'hopper' and (self.attention_block_q not in (0, 64)
                                       or self.attention_block_k not in (0, 64, 128, 256)):
      raise ValueError(f"config.model.attention='hopper' takes attention_block_q 0 or 64 (one "
                       f"warpgroup's rows; it is {self.attention_block_q}) and "
                       f'attention_block_k 0, 64, 128 or 256 (it is {self.attention_block_k})')
    if self.context_parallel == 'ring' and self.attention not in ('auto', *OUR_ATTENTION):
      raise ValueError(f"config.model.context_parallel='ring' runs our Pallas kernel on each visiting "
                       f"chunk; set --config.model.attention=pallas (it is "
                       f"{self.attention!r}), or context_parallel='all_gather'")
    if self.grad_reduce_dtype not in ('auto', 'float32', self.compute_dtype):
      # A weight reaches its matmul through a copy in the reduction dtype (model/layers.py:
      # weight), whose gradient is what crosses devices: a narrower one rounds the forward too.
      raise ValueError(f'config.model.grad_reduce_dtype={self.grad_reduce_dtype!r} with '
                       f'compute_dtype={self.compute_dtype!r}: each weight reaches its matmul '
                       f'as a {self.grad_reduce_dtype} copy, so the forward would run on rounded '
                       "weights; reduce in 'float32', or compute in "
                       f'{self.grad_reduce_dtype!r}')
    if self.qk_clip:
      self._check_qk_clip()
    if self.experts and self.mlp_activation != 'silu':
      raise ValueError(f'config.model.mlp_activation={self.mlp_activation!r}: the experts are '
                       "SwiGLU only; set mlp_activation='silu' or experts=0")
    if self.experts:
      self._check_experts()
    if self.lora_rank:
      self._check_lora()
    self._check_draft()

  def _check_qk_clip(self):
    why = ('qk_norm: the norms undo any scale of the query and key weights' if self.qk_norm
           else 'lora_rank: the base weights it would scale are frozen' if self.lora_rank
           else "attention='cudnn': its path gives no log-sum-exp yet (use pallas, xla or auto)"
           if self.attention == 'cudnn' else 'virtual_stages > 1: pipeline chunks'
           if self.virtual_stages > 1 else None)
    if why:
      raise ValueError(f'config.model.qk_clip={self.qk_clip} does not run with {why}; set '
                       'qk_clip=0 or change that setting')

  def _check_windows(self):
    if self.virtual_stages > 1:
      raise ValueError(f'config.model.sliding_window={self.sliding_window} with virtual_stages='
                       f'{self.virtual_stages}: pipeline chunks of local and global layers are '
                       'not built yet; set virtual_stages=1')
    if self.attention == 'cudnn' and self.windows == 'mixed':
      raise ValueError(f'config.model.sliding_window={self.sliding_window} with global_every='
                       f'{self.global_every}: each layer takes its window at run time, which '
                       "cuDNN cannot; set config.model.attention='pallas' (or 'auto')")

  @property
  def local_layers(self) -> tuple[bool, ...]:
    """Whether each layer, in order, attends within sliding_window (config.model.global_every
    says which do not)."""
    if not self.sliding_window:
      return (False,) * self.n_layers
    every = self.global_every
    return tuple(not (every and (i + 1) % every == 0) for i in range(self.n_layers))

  @property
  def windows(self) -> str:
    """none: every layer global | uniform: every layer local, one window | mixed: local and global
    layers, each taking its window and RoPE as the layer scan's input (known only at run time,
    which cuDNN's attention cannot take)."""
    kinds = set(self.local_layers)
    return 'mixed' if len(kinds) > 1 else 'uniform' if True in kinds else 'none'

  def _check_lora(self):
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
    if self.draft_only and not self.draft_heads:
      raise ValueError('config.model.draft_only=True trains the draft heads alone, and '
                       'config.model.draft_heads is 0; set it to the heads wanted, e.g. 3')
    if self.draft_only and self.lora_rank:
      raise ValueError('config.model.draft_only=True freezes everything but the draft heads, '
                       'adapters too; set lora_rank=0 or draft_only=False')

  def _check_experts(self):
    if self.experts < 2:
      raise ValueError(f'config.model.experts={self.experts} must be 0 (dense) or at least 2')
    if self.experts_per_token > self.experts:
      raise ValueError(f'config.model.experts_per_token={self.experts_per_token} must be between '
                       f'1 and config.model.experts={self.experts}')
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
    if self.router_bias_rate and self.router != 'sigmoid':
      raise ValueError(f'config.model.router_bias_rate={self.router_bias_rate} must be 0, or '
                       "positive with config.model.router='sigmoid' (DeepSeek-V3's "
                       'aux-loss-free balancing, e.g. 0.001)')
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
    return _dtype(self.compute_dtype)

  @property
  def reduce_dtype(self):
    """What gradients are summed across devices in: grad_reduce_dtype. A resolved run's is a
    dtype (training/settings.py: with_reduce_dtype decides 'auto'); an unresolved 'auto' is
    taken as the compute dtype, its value on GPUs (docs/precision.md)."""
    return _dtype(self.compute_dtype if self.grad_reduce_dtype == 'auto'
                  else self.grad_reduce_dtype)

  @property
  def weight_dtype(self):
    """The base parameters': param_dtype, or, frozen under adapters, the compute dtype."""
    return _dtype(self.compute_dtype if self.lora_rank else self.param_dtype)

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


AXES = ('data', 'stage', 'fsdp', 'expert', 'tensor', 'sequence')  # outermost first


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
  """The device mesh, each axis's size: -1 takes the devices left over (at most one axis), and
  `auto` has the layout search pick them (docs/memory.md)."""
  SECTION: typing.ClassVar[str] = 'mesh'
  data: int = setting(1, 'pure data parallelism: parameters replicated; the level that spans '
                      'nodes (docs/parallelism.md)', 'numerics')
  stage: int = setting(1, 'pipeline stages: each holds n_layers/stage consecutive layers '
                       '(docs/parallelism.md)', 'numerics')
  fsdp: int = setting(-1, 'ZeRO-3: parameters, gradients, optimizer state sharded; -1 takes the '
                      'rest', 'numerics')
  expert: int = setting(1, "E/expert of an MoE's experts a device, tokens sent to them; FSDP "
                        'elsewhere', 'numerics')
  tensor: int = setting(1, 'Megatron column/row-parallel attention heads and MLP', 'numerics')
  sequence: int = setting(1, 'activations split along the length', 'numerics')
  auto: bool = setting(False, 'pick mesh, remat policy and microbatches that fit, fastest first '
                       '(docs/memory.md)', 'numerics')

  def check(self):
    check_sizes(self.sizes)

  @property
  def sizes(self) -> dict[str, int]:
    """{axis: size} as given (-1 not yet filled in: sharding.mesh_shape does)."""
    return {axis: getattr(self, axis) for axis in AXES}


def check_sizes(sizes: dict) -> None:
  """Sizes positive or -1, at most one -1: ValueError naming config.mesh.<axis>."""
  if bad := [axis for axis, size in sizes.items() if size == 0 or size < -1]:
    raise ValueError(f'config.mesh.{bad[0]}={sizes[bad[0]]}: axis sizes are positive, or -1 for '
                     'the remaining devices')
  if len(free := [axis for axis, size in sizes.items() if size == -1]) > 1:
    raise ValueError(f'config.mesh: only one axis may be -1, got {free}')


@dataclasses.dataclass(frozen=True)
class PartitionConfig(Section):
  """Across nodes (docs/parallelism.md): how the state crosses `data`, the level that spans them
  (sharding/hierarchical.py)."""
  SECTION: typing.ClassVar[str] = 'partition'
  hierarchical: bool = setting(False, 'state split over data too, gathered across it once a step '
                               '(ZeRO++ hpZ)', 'numerics')
  weights: str = setting('exact', 'exact | int8: the compute copy crosses data in int8 blocks '
                         '(qwZ)', 'numerics', choices=SCHEMES)
  gradients: str = setting('exact', 'exact | int8: gradients cross data in int8 blocks, summed '
                           'in fp32 (qgZ)', 'numerics', choices=SCHEMES)

  def check(self):
    for field in ('weights', 'gradients'):
      if (value := getattr(self, field)) != 'exact' and not self.hierarchical:
        raise ValueError(f'config.partition.{field}={value!r} quantizes what crosses config.mesh.'
                         'data, which only config.partition.hierarchical=True sends apart; set it')


def tier(value: str, setting_name: str) -> tuple[str, pathlib.Path | None]:
  """(kind, directory) of a tier setting: 'device', 'host' or 'nvme:DIR' (DIR absolute, on a
  local disk); ValueError naming `setting_name` otherwise."""
  if value in (DEVICE, HOST):
    return value, None
  kind, _, directory = str(value).partition(':')
  if kind == NVME and directory.strip():
    path = pathlib.Path(directory.strip()).expanduser()
    if not path.is_absolute():
      raise ValueError(f'{setting_name}={value!r}: give the NVMe directory as an absolute path, '
                       f"such as 'nvme:/local_nvme/meshlm'")
    return NVME, path
  raise ValueError(f"{setting_name}={value!r} is not a tier: use 'device', 'host' or 'nvme:DIR' "
                   '(a directory on a local NVMe disk)')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Section):
  """AdamW, its schedule (linear warmup, then a cosine decay or warmup-stable-decay) and where
  its state lives between steps:
  off the devices, the step computes the gradients and training/tiers.py updates the state a
  group at a time, streaming it in and out (ZeRO-Infinity; docs/memory.md: tiers)."""
  SECTION: typing.ClassVar[str] = 'optimizer'
  name: str = setting('adamw', "adamw | muon: each weight matrix's update orthogonalised "
                      "(optax.contrib.muon's Newton–Schulz, Nesterov momentum), AdamW for the "
                      'embedding, head, norms, router and adapters', 'schedule',
                      choices=OPTIMIZERS)
  muon_momentum: float = setting(0.95, "muon: its momentum's decay", 'schedule', range=SHARE)
  muon_ns_steps: int = setting(5, 'muon: Newton–Schulz iterations a step', 'schedule',
                               range=at_least(1))
  muon_rms: float = setting(0.2, "muon: each update scaled to this RMS × √max(fan_in, fan_out) "
                            "(Moonlight's 0.2 matches AdamW's, so its learning_rate and "
                            "weight_decay carry over); 0: optax's √max(1, fan_out/fan_in)",
                            'schedule', range=at_least(0))
  muon_ns_dtype: str = setting('bfloat16', "muon: Newton–Schulz's dtype (Keller Jordan's and "
                               "Moonlight's bfloat16; float32 as optax's)", 'numerics',
                               choices=('bfloat16', 'float32'))
  muon_layout: str = setting('round_robin', 'muon: round_robin: each device orthogonalises a '
                             'share of the stacked matrices (layers, experts) whole and sends the '
                             "results back to their shards | as_params: on the parameters' own "
                             'shards, as XLA partitions it (operands gathered and partial sums '
                             'all-reduced in every iteration)', 'numerics', choices=MUON_LAYOUTS)
  learning_rate: float = setting(3e-3, 'the peak, after warmup', 'schedule', range=at_least(0))
  warmup_steps: int = setting(10, 'steps of linear warmup from 0', 'schedule', range=at_least(0))
  min_lr_ratio: float = setting(0.1, 'the schedule decays to learning_rate × this at '
                                'train_steps', 'schedule', range=between(0, 1))
  schedule: str = setting('cosine', 'cosine: a cosine decay from the warmup on | wsd: '
                          'warmup-stable-decay, learning_rate held until the last decay_fraction '
                          'of train_steps, then decayed (a run goes on from a checkpoint of its '
                          'plateau with more train_steps, and decays later)', 'schedule',
                          choices=SCHEDULES)
  decay_fraction: float = setting(0.2, "wsd: the share of train_steps its decay takes",
                                  'schedule', range=between(0, 1))
  decay_shape: str = setting('linear', 'wsd: the decay linear, or sqrt: 1 − √progress '
                             '(Hägele et al. 2024)', 'schedule', choices=DECAY_SHAPES)
  b1: float = setting(0.9, "Adam's β1", 'schedule', range=SHARE)
  b2: float = setting(0.95, "Adam's β2", 'schedule', range=SHARE)
  eps: float = setting(1e-8, "Adam's ε", 'schedule', range=at_least(0))
  weight_decay: float = setting(0.1, 'decoupled, not applied to norm scales', 'schedule',
                                range=at_least(0))
  grad_clip: float = setting(1.0, 'global-norm clipping; 0 turns it off', 'schedule',
                             range=at_least(0))
  offload_state: bool = setting(False, "keep Adam's moments in pinned host memory between steps "
                                '(ZeRO-Offload)', 'numerics')
  master_tier: str = setting(DEVICE, "the fp32 master weights' tier: device, host or nvme:DIR "
                             '(each process its own files under DIR)', 'numerics')
  mu_tier: str = setting(DEVICE, "Adam's first moment's tier", 'numerics')
  nu_tier: str = setting(DEVICE, "Adam's second moment's tier", 'numerics')

  def check(self):
    for name in TIERED:
      tier(getattr(self, name), f'config.optimizer.{name}')
    if self.name == 'muon' and (self.tiered or self.offload_state):
      raise ValueError("config.optimizer.name='muon' updates each matrix whole inside the step; "
                       'the tiers and offload_state update the state elementwise outside it: '
                       "keep master_tier, mu_tier and nu_tier at 'device' and offload_state "
                       "False, or use name='adamw'")
    if self.offload_state and self.tiered:
      raise ValueError('config.optimizer.offload_state=True keeps the moments in pinned host '
                       'memory inside the compiled step, and the tiers (master_tier, mu_tier, '
                       "nu_tier) keep the state outside it; use one: mu_tier='host', "
                       "nu_tier='host' and offload_state=False, or the tiers at 'device'")

  @property
  def tiered(self) -> bool:
    """Whether any of the state lives off the devices: then training/tiers.py updates it."""
    return any(getattr(self, name) != DEVICE for name in TIERED)

  @property
  def master_on_devices(self) -> bool:
    """Whether the devices' parameters are the master weights (else a copy in the compute
    dtype, which is what the step reads of them)."""
    return self.master_tier == DEVICE

  @property
  def placements(self) -> dict[str, tuple[str, pathlib.Path | None]]:
    """{'master': (tier, directory), 'mu': …, 'nu': …}: where each part of the state lives."""
    return {name.removesuffix('_tier'): tier(getattr(self, name), f'config.optimizer.{name}')
            for name in TIERED}


@dataclasses.dataclass(frozen=True)
class LossConfig(Section):
  """The language model's loss beside its cross-entropy."""
  SECTION: typing.ClassVar[str] = 'loss'
  z_loss: float = setting(1e-4, 'weight of log(Z)², which keeps the softmax normaliser near 1',
                          'schedule', range=at_least(0))


@dataclasses.dataclass(frozen=True)
class DpoConfig(Section):
  """Direct preference optimisation (docs/fine-tuning.md: DPO), the loss of preference records:
  −(1−ε)·log σ(β·h) − ε·log σ(−β·h), h = (log π − log π_ref)(chosen) − (log π − log
  π_ref)(rejected); the reference π_ref is the run's starting model (under LoRA the base)."""
  SECTION: typing.ClassVar[str] = 'dpo'
  beta: float = setting(0.1, 'β: how far from the reference the policy may move for a margin',
                        'schedule', range=POSITIVE)
  label_smoothing: float = setting(0.0, "ε: the share of pairs taken to be mislabelled "
                                   '(conservative DPO)', 'schedule',
                                   range=(lambda value: 0 <= value < 0.5, 'in [0, 0.5)'))


@dataclasses.dataclass(frozen=True)
class DistributedConfig(Section):
  """Multi-process jobs (runtime/distributed.py): the explicit settings all given, or none (SLURM
  or Open MPI, if present, else one process)."""
  SECTION: typing.ClassVar[str] = 'distributed'
  coordinator_address: str = setting('', "process 0's host:port; '': SLURM/Open MPI if present, "
                                     'else 1 process', 'none')
  num_processes: int = setting(0, 'with coordinator_address: how many processes the job has',
                               'none', range=at_least(0))
  process_id: int = setting(-1, "with coordinator_address: this process's rank, 0 … "
                            'num_processes-1', 'none', range=at_least(-1))
  initialization_timeout_s: int = setting(300, 'how long processes wait for each other at the '
                                          'start', 'none', range=POSITIVE)
  heartbeat_timeout_s: int = setting(100, 'a process silent this long is dead: the others stop '
                                     'with an error', 'none', range=POSITIVE)

  def check(self):
    if not self.coordinator_address:
      if self.num_processes or self.process_id != -1:
        raise ValueError('config.distributed.num_processes/process_id are set but '
                         'config.distributed.coordinator_address is empty; give process 0\'s '
                         'host:port too (or none of them under SLURM or Open MPI)')
      return
    if ':' not in self.coordinator_address:
      raise ValueError(f'config.distributed.coordinator_address={self.coordinator_address!r}'
                       ' must be host:port of process 0, e.g. 10.0.0.1:1234')
    n, i = self.num_processes, self.process_id
    if n < 1 or not 0 <= i < n:
      raise ValueError(f'config.distributed.num_processes={n} and process_id={i}: need '
                       'num_processes ≥ 1 and 0 ≤ process_id < num_processes')


@dataclasses.dataclass(frozen=True)
class PlanConfig(Section):
  """What the step compiles for and must fit in (planning/target.py)."""
  SECTION: typing.ClassVar[str] = 'plan'
  target: str = setting('', "A100 | H100 | H100-PCIe | H200 (planning/gpus.py): plan for it; "
                        "'': the devices here", 'none')
  devices: int = setting(0, 'how many of config.plan.target to plan for; 0: as many as there '
                         'are devices here', 'none', range=at_least(0))
  memory_gb: float = setting(0.0, "per-device memory to fit; 0: the target's, or the backend's "
                             'own', 'none', range=at_least(0))


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
  """Where the text comes from, what a record is, and how it becomes tokens (docs/data.md; a
  .jsonl, .jsonl.gz or .parquet file in `paths` holds a document a record: docs/fine-tuning.md).
  Its checks that cross files are data/tokens.py's; the chat template's, data/chat.py's."""
  SECTION: typing.ClassVar[str] = 'data'
  paths: str = setting('stdlib', "files, dirs or globs, comma-separated; stdlib: the Python "
                       "stdlib's .py files", 'data')
  name: str = setting('', 'a TFDS dataset already prepared in data_dir (array_record); replaces '
                      '`paths`', 'data')
  text_key: str = setting('text', 'the text feature of a named dataset, or field of a record',
                          'data')
  record: str = setting('text', 'text | prompt_completion | messages (chat: [{"role", '
                        '"content"}, …]) | preference: a prompt, a chosen and a rejected answer, '
                        'trained on by DPO (config.dpo) | chat_preference: the same pair as '
                        'conversations', 'data', choices=RECORDS)
  prompt_field: str = setting('prompt', "prompt_completion and the preference kinds: the "
                              "record's prompt field", 'data')
  completion_field: str = setting('completion', "prompt_completion: the record's completion "
                                  'field', 'data')
  chosen_field: str = setting('chosen', 'the preference kinds: the answer preferred', 'data')
  rejected_field: str = setting('rejected', 'the preference kinds: the answer not', 'data')
  messages_field: str = setting('messages', "messages: the record's field", 'data')
  chat_template: str = setting('auto', "auto: the tokenizer's own (tokenizer_config.json), else "
                               'fallback | fallback | a .jinja file', 'data')
  train_on: str = setting('answers', 'answers: loss on the completion or assistant turns only | '
                          'all', 'data', choices=TRAIN_ON)
  train_split: str = setting('train', "a named dataset's training split (`paths` corpora have "
                             'train and validation)', 'data')
  eval_split: str = setting('validation', "a named dataset's validation split", 'none')
  validation_fraction: float = setting(0.02, 'of the files in `paths` held out, chosen by a hash '
                                       'of the path', 'data', range=SHARE)
  data_dir: str = setting('', "TFDS data dir; '' is TFDS's default ($TFDS_DATA_DIR or "
                          '~/tensorflow_datasets)', 'none')
  tokenizer: str = setting('byte', 'byte | sentencepiece | hf (a Hugging Face tokenizer.json)',
                           'data', choices=TOKENIZERS)
  tokenizer_model: str = setting('', 'sentencepiece: a .model (data.train_tokenizer); hf: a '
                                 'tokenizer.json', 'data')
  tokenize: str = setting('auto', 'once: token ids stored at preparation | on_the_fly | auto: '
                          'once, but byte on the fly', 'none', choices=TOKENIZE)
  workers: int = setting(0, 'grain worker processes (0: in the training process); the batches '
                         'are the same', 'none', range=at_least(0))
  prefetch: int = setting(2, 'batches each worker prepares ahead', 'none', range=at_least(1))

  @property
  def preference(self) -> bool:
    """Whether records are preference pairs, trained on by DPO (config.dpo)."""
    return self.record in PREFERENCE_RECORDS


@dataclasses.dataclass(frozen=True)
class LmEvalConfig(Section):
  """lm-eval's tasks during training (docs/evaluation.md): scored on the parameters in memory,
  each task's metrics in metrics.jsonl and TensorBoard as <task>/<metric>; train.py adds the
  hook (evaluation/during.py)."""
  SECTION: typing.ClassVar[str] = 'lm_eval'
  tasks: str = setting('', "lm-eval task or group names, comma-separated (stdlib_next_line, …); "
                       "'': none", 'none')
  every: int = setting(1000, 'steps between scorings, and one at the last step (0: only that '
                       'one)', 'none', range=at_least(0))
  limit: float = setting(0.0, 'examples a task at most (a fraction below 1); 0: all of them',
                         'none', range=at_least(0))
  include_path: str = setting('', 'more directories of task YAMLs, comma-separated '
                              '(evaluation/tasks/ always)', 'none')
  batch_size: int = setting(16, 'rows a forward', 'none', range=at_least(1))

  @property
  def task_names(self) -> list[str]:
    return [name.strip() for name in self.tasks.split(',') if name.strip()]

  @property
  def include_paths(self) -> list[str]:
    return [path.strip() for path in self.include_path.split(',') if path.strip()]


@dataclasses.dataclass(frozen=True)
class Start:
  """Where a run's parameters come from (config.init_from), found once by settings.resolve."""
  init_from: str  # as given: '', random, hf:DIR, or a run's workdir or checkpoint
  kind: str = ''  # HF, RUN, or '' (fresh parameters)
  path: pathlib.Path | None = None  # HF: the checkpoint's directory; RUN: the run's workdir
  saved: dict | None = dataclasses.field(default=None, compare=False)  # RUN: its saved config

  @property
  def fresh(self) -> bool:
    return not self.kind


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """A run, resolved once (training/settings.py: resolve): every setting, typed and checked, with
  what the config left open filled in (the base model and tokenizer it starts from, the
  vocabulary, the attention kernel, the layout), and what resolving found (the tokenizer and chat
  template, where the run starts, the Target its programs are compiled for). Nothing below the
  entry points reads the raw config, and nothing rewrites a Run but `replace`.

    run = settings.resolve(config)
    run.model.d_model, run.mesh.fsdp, run.data.tokenizer, run.target.name, run.tokenizer.name

  `as_dict` is the config as a run saves it (workdir/config.json, each checkpoint), the form a
  resumed run and sample.py read back."""
  workdir: str = setting('/tmp/meshlm', 'where metrics.jsonl, config.json and checkpoints go',
                         'none')
  seed: int = setting(0, 'the parameters\' and the batches\' draw', 'data', range=at_least(0))
  train_steps: int = setting(100, 'steps to train; the schedule decays over them', 'schedule',
                             range=at_least(1))
  log_every: int = setting(10, 'steps between metrics lines', 'none', range=at_least(1))
  eval_every: int = setting(50, 'steps between evaluations of the validation split; 0: none',
                            'none', range=at_least(0))
  eval_batches: int = setting(4, 'batches of the validation split per evaluation; 0: all of it',
                              'none', range=at_least(0))
  checkpoint_every: int = setting(50, 'steps between asynchronous checkpoints (and one at the '
                                  'end); 0: none', 'none', range=at_least(0))
  keep_checkpoints: int = setting(3, 'the newest this many are kept', 'none', range=at_least(1))
  init_from: str = setting('', "a run's workdir (or checkpoints/<step>): start from its "
                           'parameters only; or hf:DIR, a Hugging Face checkpoint; either sets '
                           "the base model (docs/huggingface.md). '': fresh parameters; random: "
                           'fresh ones on purpose, which a frozen base (LoRA) must say', 'data')
  init_adapters: str = setting('merge', 'init_from a run that trained LoRA adapters: merge '
                               '(start from the model they make, W + (alpha/r)·AB) | leave (from '
                               'the base they adapted, without them)', 'data',
                               choices=INIT_ADAPTERS)
  dry_run: bool = setting(False, 'compile the step, print its memory/FLOPs/collectives plan, and '
                          'stop', 'none')
  max_bad_steps: int = setting(5, 'this many steps in a row with a non-finite loss or gradient '
                               'stop the run', 'none', range=at_least(1))
  profile_steps: int = setting(0, 'trace this many steps into workdir/profile (TensorBoard, '
                               'Perfetto); 0: none', 'none', range=at_least(0))
  profile_start: int = setting(5, 'the trace starts this many steps into the run, after '
                               'compilation and warm-up', 'none', range=at_least(0))
  batch_size: int = setting(16, 'global, in sequences', 'data', range=at_least(1))
  microbatches: int = setting(1, 'gradient accumulation: the batch runs as this many slices '
                              'inside the step', 'numerics', range=at_least(1))
  seq_len: int = setting(128, 'tokens a row', 'data', range=at_least(1))
  model: ModelConfig = section(ModelConfig)
  mesh: MeshConfig = section(MeshConfig)
  partition: PartitionConfig = section(PartitionConfig)
  optimizer: OptimizerConfig = section(OptimizerConfig)
  loss: LossConfig = section(LossConfig)
  dpo: DpoConfig = section(DpoConfig)
  distributed: DistributedConfig = section(DistributedConfig)
  plan: PlanConfig = section(PlanConfig)
  data: DataConfig = section(DataConfig)
  lm_eval: LmEvalConfig = section(LmEvalConfig)
  # What resolving found: not settings, never saved.
  tokenizer: typing.Any = dataclasses.field(default=None, compare=False)  # data.tokenizers'
  template: typing.Any = None  # the chat template its records render with (data/chat.py: owned)
  start: Start | None = None
  target: typing.Any = dataclasses.field(default=None, compare=False)  # planning.target.Target

  def __post_init__(self):
    for name, declared, _ in schema.declared(type(self)):
      if '.' not in name:
        schema.check_value(name, getattr(self, name), declared)

  @classmethod
  def of(cls, values: dict, **resolved) -> 'Run':
    """A Run from a config's values (nested dicts, every setting; settings.resolve fills them),
    each section built, so checked, by its own type."""
    built = {name: kind(**values[name]) for name, kind in sections(cls).items()}
    return cls(**{**values, **built, **resolved})

  def as_dict(self) -> dict:
    """The settings as nested dicts, as get_config lays them out (what a run saves)."""
    return {field.name: (dataclasses.asdict(getattr(self, field.name))
                         if 'section' in field.metadata else getattr(self, field.name))
            for field in dataclasses.fields(self)
            if 'setting' in field.metadata or 'section' in field.metadata}

  def differentiates_bf16(self) -> bool:
    """Whether the step's trained parameters are bf16: in param_dtype, or the compute-dtype copy
    of master weights kept off the devices (training/tiers.py)."""
    opt = self.optimizer
    dtype = (self.model.compute_dtype if opt.tiered and not opt.master_on_devices
             else self.model.param_dtype)
    return dtype == 'bfloat16'

  def untiered_because(self) -> str | None:
    """Why the optimizer state's tiers (training/tiers.py) do not run with this run yet, or
    None where they do."""
    model = self.model
    return (f'config.model.lora_rank={model.lora_rank} trains adapters small enough for the '
            'devices' if model.lora_rank else
            f'config.model.draft_heads={model.draft_heads} clips the heads apart'
            if model.draft_heads else
            "config.model.router_bias_rate steps the routers' bias inside the step"
            if model.router_bias_rate else
            "config.data.record='preference' (DPO) keeps a reference model in the state"
            if self.data.preference else
            "config.optimizer.name='muon' updates each matrix whole inside the step"
            if self.optimizer.name == 'muon' else
            f'config.model.qk_clip={model.qk_clip} scales weights inside the step'
            if model.qk_clip else None)

  def replace(self, **changes) -> 'Run':
    """This run with some settings changed: `section={field: value}` for a section's fields,
    `name=value` for a top-level one. Each section rebuilt is checked again."""
    kinds = sections(type(self))
    return dataclasses.replace(self, **{
        name: (dataclasses.replace(getattr(self, name), **value)
               if name in kinds and isinstance(value, dict) else value)
        for name, value in changes.items()})


def get_config() -> ml_collections.ConfigDict:
  """Every setting at its default: the config every other config starts from."""
  return config_dict(Run)


# What changing each setting does to a run (configs/effects.py), as each field declares it.
EFFECTS = schema.effects(Run)


def drops_tokens(config) -> bool:
  """Whether a config (or a saved one) routes tokens past an expert's room: an MoE with a
  capacity or an expert buffer (model/moe.py)."""
  model = config['model']
  return bool(model.get('experts', 0)) and (model.get('capacity_factor', 0) > 0
                                            or model.get('expert_buffer', 0) > 0)


# Where what a setting changes depends on the rest of the run: {field: (its kind then, when, why)}.
# An MoE that drops tokens keeps those an expert has room for among the tokens one device routes
# at once, which the mesh and the microbatches decide: there the layout is part of the function.
DEPENDS = {field: ('function', drops_tokens, "the run's MoE drops the tokens past an expert's room "
                   'among those each device routes at once')
           for field in """microbatches mesh.data mesh.stage mesh.fsdp mesh.expert mesh.tensor
               mesh.sequence mesh.auto""".split()}


if __name__ == '__main__':  # docs/settings.md's table
  print(schema.table(Run), end='')
