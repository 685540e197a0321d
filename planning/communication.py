"""The ideal communication of one train step: the bytes each device must send, by what it sends.

What a compiled step actually sends is sharding.collectives.summary of its HLO; this is the
yardstick it is held to (benchmarks/collectives.py prints both). Ring algorithms, as NCCL's: with
ρ(n) = (n−1)/n, an all-gather of X bytes sends X·ρ(n) per device, a reduce-scatter of X bytes
(before the scatter) X·ρ(n), an all-reduce 2·X·ρ(n).

Symbols: mesh data d, stage P, fsdp f, expert e, tensor t, sequence s; g = f·s·e (parameters
outside the experts are split along 'embed' over all three), g_X = f·s (an expert's are split
over e by expert); M microbatches, b = B/(d·f·e·M) rows per device and microbatch, L the sequence
length; T = V·M + P − 1 ticks of the pipeline schedule with V virtual stages (T = M without
stages: each tick a stage runs one chunk, n_layers/(V·P) layers, on one microbatch, bubble ticks
included, model/pipeline.py);
c bytes of the compute dtype, r of the gradient reduction (config.model.grad_reduce_dtype);
P_L the layers' matmul parameters outside the experts (routers and shared experts included),
P_X the routed experts' (E·3·D·F_X in each of the n_X MoE layers), k experts a token, P_E the
embedding table V·D, P_U the untied head D·V (0 when tied), P_N the norm scales (replicated).
Per step:

  layers    (ZeRO-3) each layer's weights gathered once forward and once backward per microbatch
            (recomputation reuses the backward's gather), gradients reduce-scattered once per
            microbatch; a stage does so for a chunk every tick:  T·(2c + r)·P_L/(V·P·t)·ρ(g)
  experts   the same for the routed experts, gathered only over g_X:
            T·(2c + r)·P_X/(V·P·t·e)·ρ(g_X)
  all_to_all each MoE layer's assignments (b·(L/s)·k rows of D) sent to their experts' devices
            and back forward, and their gradients backward; forward again under any remat
            policy, whose saved names do not include the experts' own residuals (model/moe.py),
            a share (e−1)/e of them leaving the device when the experts are balanced:
            T·(4|6)·n_X/(V·P)·b·(L/s)·k·D·c·ρ(e)
  embedding the table gathered once per microbatch (once a step with stages, which run the
            embedding and head on the whole batch) in the compute dtype (the lookup and a tied
            head share it), an untied head's too (kept for the backward), and the head weight's
            gradient reduce-scattered once; the lookup's gradient exchanged for the device's
            slice of D or reduce-scattered, whichever is less (model/embedding.py), for
            T_E = b·L/s tokens a device (b·M·L/s with stages):
            M'·((P_E + P_U)·c/t + V·D·r/t + min(T_E·(D·c + 4), P_E·r/t))·ρ(g)
            (M' = M, or 1 with stages)
  data      the gradient shards all-reduced over data once a step:
            2·r·((P_L/P + P_E + P_U)/g + P_X/(P·g_X·e))/t·ρ(d);
            hierarchical (config.partition, sharding/hierarchical.py): the compute copy gathered
            over data once a step and the gradients reduce-scattered there once, w and q bytes a
            parameter (w: c, or int8's 1 + 4/256 with its block's scale; q: r, or the same int8):
            (w + q)·(P_L/P + P_E + P_U)/(g·t)·ρ(d)
  norms     their gradients all-reduced over every device that holds a copy: 2·4·P_N·ρ(d·g·t)
  tensor    Megatron's activation all-reduces, 2 forward and 2 backward a layer (2 more under
            remat `full`, which runs the forward again), one after the vocabulary-split lookup
            and one for the head's input gradient:
            (T·(4|6)·n_layers/(V·P) + 2M)·2c·b·(L/s)·D·ρ(t)
  sequence  all_gather: keys and values gathered forward, their gradients reduce-scattered backward
            (gathered again under `full`): M·(4|6)·n_layers·b·L·(K/t)·H·c·ρ(s);
            ring: keys and values go round the ring forward and again backward (forward again
            under `full`), their gradients once, in r: M·n_layers·b·L·(K/t)·H·((4|6)·c + 2r)·ρ(s)
  stage     a microbatch's activations passed on every tick, forward and (their gradient)
            backward, by collective-permute: 2·T·b·(L/s)·D·c; the last stage's outputs summed
            to every stage, and the input's gradient back, in fp32: 2·2·M·b·(L/s)·D·4·ρ(P);
            the head and loss, which each stage runs on its share of the microbatches
            (model/transformer.py), the head weight's gradient summed over stages in fp32:
            2·4·V·D/(t·g)·ρ(P), and their per-token losses: 2·4·⌈M/P⌉·P·b·(L/s)·ρ(P)
"""

import math

from model import ModelConfig
import sharding
from sharding.hierarchical import BLOCK


def rho(n: int) -> float:
  return (n - 1) / n


INT8_BYTES = 1 + 4 / BLOCK  # an int8 element with its share of its block's fp32 scale

# The mesh axes each component's collectives run over, for what crosses nodes (across_nodes).
AXES_OF = {'layers': ('fsdp', 'sequence', 'expert'), 'experts': ('fsdp', 'sequence'),
           'all_to_all': ('expert',), 'embedding': ('fsdp', 'sequence', 'expert'),
           'data': ('data',), 'norms': sharding.AXES, 'tensor': ('tensor',),
           'sequence': ('sequence',), 'stage': ('stage',)}


def ideal_bytes(cfg: ModelConfig, mesh: dict, batch_size: int, seq_len: int,
                microbatches: int = 1, remat_policy: str = 'none',
                grad_reduce_bytes: int | None = None, partition=None) -> dict[str, float]:
  """{component: bytes each device sends per step} per the module docstring; `partition`,
  config.partition (None: plain FSDP); `grad_reduce_bytes`, r (None: cfg's reduction dtype's)."""
  d, P, f, e, t, s = (mesh.get(axis, 1)
                      for axis in ('data', 'stage', 'fsdp', 'expert', 'tensor', 'sequence'))
  g, g_x, M, c = f * s * e, f * s, microbatches, cfg.dtype.itemsize
  r = cfg.reduce_dtype.itemsize if grad_reduce_bytes is None else grad_reduce_bytes
  b = batch_size / (d * f * e * M)
  V = cfg.virtual_stages if P > 1 else 1
  T = V * M + P - 1
  full = remat_policy == 'full'
  n_x, D, F_x = cfg.moe_layers, cfg.d_model, cfg.expert_width
  layers = (cfg.n_layers * D * cfg.head_dim * 2 * (cfg.n_heads + cfg.n_kv_heads)
            + (cfg.n_layers - n_x) * 3 * D * cfg.d_ff
            + n_x * (D * cfg.experts + cfg.shared_experts * 3 * D * F_x))
  experts = n_x * cfg.experts * 3 * D * F_x
  table = cfg.vocab_size * cfg.d_model
  head = 0 if cfg.tie_embeddings else table
  norms = (2 * cfg.n_layers + 1) * cfg.d_model
  activation = b * seq_len / s * cfg.d_model * c  # a microbatch's, per device
  lookups = 1 if P > 1 else M
  lookup_tokens = b * seq_len / s * M / lookups
  lookup_grad = min(lookup_tokens * (cfg.d_model * c + 4), table * r / t)
  if partition is not None and partition.hierarchical:
    w = INT8_BYTES if partition.weights == 'int8' else c
    q = INT8_BYTES if partition.gradients == 'int8' else r
    data = (w + q) * (layers / P + table + head) / (g * t) * rho(d)
  else:
    data = 2 * r * ((layers / P + table + head) / g + experts / (P * g_x * e)) / t * rho(d)
  return {
      'layers': T * (2 * c + r) * layers / (V * P * t) * rho(g),
      'experts': T * (2 * c + r) * experts / (V * P * t * e) * rho(g_x),
      'all_to_all': (T * (4 if remat_policy == 'none' else 6) * n_x / (V * P) * b * seq_len / s
                     * cfg.experts_per_token * D * c * rho(e)),
      'embedding': lookups * ((table + head) * c / t + table * r / t + lookup_grad) * rho(g),
      'data': data,
      'norms': 2 * 4 * norms * rho(d * g * t),
      'tensor': (T * (6 if full else 4) * cfg.n_layers / (V * P) + 2 * M) * 2 * activation
                * rho(t),
      'sequence': (M * cfg.n_layers * b * seq_len * cfg.n_kv_heads / t * cfg.head_dim * rho(s)
                   * ((6 if full else 4) * c + (2 * r if cfg.context_parallel == 'ring' else 0))),
      'stage': ((2 * T + 4 * M * rho(P) * 4 / c) * activation
                + 2 * 4 * (table / (t * g) + -(-M // P) * P * b * seq_len / s) * rho(P)
                if P > 1 else 0.0),
  }


def ideal_total(*args, **kwargs) -> float:
  return math.fsum(ideal_bytes(*args, **kwargs).values())


def spans_nodes(axes, mesh: dict, gpus_per_node: int) -> bool:
  """Whether a group over mesh `axes` holds devices of more than one node: the devices fill
  nodes in the mesh's order (sharding.AXES, the first varying slowest)."""
  stride = 1
  for axis in reversed(sharding.AXES):
    size = mesh.get(axis, 1)
    if axis in axes and size > 1 and size * stride > gpus_per_node:
      return True
    stride *= size
  return False


def across_nodes(ideal: dict[str, float], mesh: dict, gpus_per_node: int) -> float:
  """Of an ideal_bytes, what the collectives of groups spanning nodes send."""
  return math.fsum(sent for part, sent in ideal.items()
                   if spans_nodes(AXES_OF[part], mesh, gpus_per_node))
