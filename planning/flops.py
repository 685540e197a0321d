"""Model FLOPs per token, and MFU against the device's peak (planning/gpus.py), by MaxText's
convention:

  dense     = 6 · (n_layers · matmul params per layer + d_model · vocab)  per token
              (the embedding lookup is not a matmul; the output head is, tied or not; an MoE
              layer counts its active parameters: router, k routed and the shared experts)
  attention = 12 · n_layers · n_heads · head_dim · seq_len               per token,
              halved when causal (only the lower triangle of QKᵀ and PV is useful work)
Rematerialised recomputation is not credited: MFU counts the model's work, not the program's.
Under LoRA the frozen weights take no gradient: they count 4 · params (forward, and the
activations' gradients through them), the adapters 6 · theirs. Draft heads (model/draft.py) count
6 · their own weights and 4 · the shared head's (no gradient reaches it); training them alone
(draft_only), the base runs forward only: 2 · params, and a third of the attention.
"""

from configs.base import ModelConfig
from kernels.flash_attention import keys_seen
from planning import gpus


def peak_tflops(device_kind: str) -> float | None:
  """The dense bf16 peak (planning/gpus.py) for a jax device_kind such as 'NVIDIA H100 80GB
  HBM3' or a GPU name; None for devices not in that table."""
  gpu = gpus.find(device_kind)
  return gpu.peak_bf16_flops / 1e12 if gpu else None


def matmul_params_per_layer(cfg: ModelConfig, experts: bool = False) -> int:
  """The weights a token is multiplied by in one layer: attention and the MLP (gate, up, down),
  or in an MoE layer (`experts`) the router and the k experts and shared experts it takes, its
  active parameters."""
  attention = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)  # q, o, k, v
  if not experts:
    return attention + 3 * cfg.d_model * cfg.d_ff
  taken = cfg.experts_per_token + cfg.shared_experts
  return attention + cfg.d_model * cfg.experts + 3 * cfg.d_model * cfg.expert_width * taken


def adapter_params_per_layer(cfg: ModelConfig) -> int:
  """The LoRA adapters' parameters in one layer: r · (fan in + fan out) of each target."""
  D, F = cfg.d_model, cfg.d_ff
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  sizes = {'q': D + q, 'k': D + kv, 'v': D + kv, 'o': q + D, 'gate': D + F, 'up': D + F,
           'down': F + D}
  return cfg.lora_rank * sum(sizes[t] for t in cfg.lora_target_names) if cfg.lora_rank else 0


def draft_flops_per_token(cfg: ModelConfig) -> float:
  """The draft heads' training FLOPs a token: each head's D × D weights (Wh, Wo and Clover's We)
  forward and backward, and the base's head forward and back to its input."""
  own = (3 if cfg.draft_kind == 'clover' else 2) * cfg.d_model ** 2
  return cfg.draft_heads * (6 * own + 4 * cfg.d_model * cfg.vocab_size)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
  """Attention's score and value matmuls a token, forward and backward: a local layer's within
  its sliding window only."""
  if not causal:
    return 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
  keys = sum(keys_seen(seq_len, cfg.sliding_window if local else 0) for local in cfg.local_layers)
  return 12 * cfg.n_heads * cfg.head_dim * keys


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True,
                    reference: bool = False) -> float:
  """A train step's model FLOPs a token; `reference`: DPO's, with its reference model's forward."""
  layers = ((cfg.n_layers - cfg.moe_layers) * matmul_params_per_layer(cfg)
            + cfg.moe_layers * matmul_params_per_layer(cfg, experts=True))
  # Frozen under LoRA: no weight gradient; under draft_only, no backward at all.
  weights = 2 if cfg.draft_only else 4 if cfg.lora_rank else 6
  dense = weights * (layers + cfg.d_model * cfg.vocab_size)
  dense += 6 * cfg.n_layers * adapter_params_per_layer(cfg) + draft_flops_per_token(cfg)
  attention = attention_flops_per_token(cfg, seq_len, causal)
  if reference:  # one more forward, no gradient
    dense += 2 * (layers + cfg.d_model * cfg.vocab_size)
    attention += attention / 3
  return dense + attention / (3 if cfg.draft_only else 1)


def throughput(cfg: ModelConfig, seq_len: int, tokens_per_sec: float, n_devices: int,
               device_kind: str, reference: bool = False) -> dict[str, float]:
  """{'tflops_per_device', and 'mfu' where the device's peak is known}: the model's FLOPs
  (flops_per_token) at `tokens_per_sec` over `n_devices`, against the bf16 peak."""
  tflops = flops_per_token(cfg, seq_len, reference=reference) * tokens_per_sec / n_devices / 1e12
  peak = peak_tflops(device_kind)
  return {'tflops_per_device': tflops, **({'mfu': tflops / peak} if peak else {})}
