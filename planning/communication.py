"""The ideal communication of one train step: the bytes each device must send, by what it sends.

What a compiled step actually sends is sharding.collectives.summary of its HLO; this is the
yardstick it is held to (benchmarks/collectives.py prints both). Ring algorithms, as NCCL's: with
ρ(n) = (n−1)/n, an all-gather of X bytes sends X·ρ(n) per device, a reduce-scatter of X bytes
(before the scatter) X·ρ(n), an all-reduce 2·X·ρ(n).

Symbols: mesh data d, fsdp f, tensor t, sequence s; g = f·s (parameters are split along 'embed'
over both); M microbatches, b = B/(d·f·M) rows per device and microbatch, L the sequence length;
c bytes of the compute dtype, r of the gradient reduction (config.optimizer.grad_reduce_dtype);
P_L the layers' matmul parameters, P_E the embedding table V·D, P_U the untied head D·V (0 when
tied), P_N the norm scales (replicated). Per step:

  layers    (ZeRO-3) each layer's weights gathered once forward and once backward per microbatch
            (recomputation reuses the backward's gather), gradients reduce-scattered once per
            microbatch:   M·(2c + r)·P_L/t·ρ(g)
  embedding the table gathered once per microbatch in the compute dtype (the lookup and a tied
            head share it), its gradient reduce-scattered once:  M·(c + r)·P_E/t·ρ(g);
            an untied head likewise (its forward gather kept for the backward): M·(c + r)·P_U/t·ρ(g)
  data      the gradient shards all-reduced over data once a step: 2·r·(P_L + P_E + P_U)/(t·g)·ρ(d)
  norms     their gradients all-reduced over every device that holds a copy: 2·4·P_N·ρ(d·f·s·t)
  tensor    Megatron's activation all-reduces, 2 forward and 2 backward a layer (2 more under
            remat `full`, which runs the forward again), one after the vocabulary-split lookup and one for the head's input
            gradient: M·(4|6 · n_layers + 2)·2c·b·(L/s)·D·ρ(t)
  sequence  all_gather: keys and values gathered forward, their gradients reduce-scattered backward
            (gathered again under `full`): M·(4|6)·n_layers·b·L·(K/t)·H·c·ρ(s);
            ring: keys and values go round the ring forward and again backward (forward again
            under `full`), their gradients once, in r: M·n_layers·b·L·(K/t)·H·((4|6)·c + 2r)·ρ(s)
"""

import math

from model import ModelConfig


def rho(n: int) -> float:
  return (n - 1) / n


def ideal_bytes(cfg: ModelConfig, mesh: dict, batch_size: int, seq_len: int,
                microbatches: int = 1, remat_policy: str = 'none',
                grad_reduce_bytes: int = 4) -> dict[str, float]:
  """{component: bytes each device sends per step} per the module docstring."""
  d, f, t, s = (mesh.get(axis, 1) for axis in ('data', 'fsdp', 'tensor', 'sequence'))
  g, M, c, r = f * s, microbatches, cfg.dtype.itemsize, grad_reduce_bytes
  b = batch_size / (d * f * M)
  full = remat_policy == 'full'
  layers = cfg.n_layers * (cfg.d_model * cfg.head_dim * 2 * (cfg.n_heads + cfg.n_kv_heads)
                           + 3 * cfg.d_model * cfg.d_ff)
  table = cfg.vocab_size * cfg.d_model
  head = 0 if cfg.tie_embeddings else table
  norms = (2 * cfg.n_layers + 1) * cfg.d_model
  tensor_reductions = (6 if full else 4) * cfg.n_layers + 2
  return {
      'layers': M * (2 * c + r) * layers / t * rho(g),
      'embedding': M * (c + r) * (table + head) / t * rho(g),
      'data': 2 * r * (layers + table + head) / (t * g) * rho(d),
      'norms': 2 * 4 * norms * rho(d * f * s * t),
      'tensor': M * tensor_reductions * 2 * c * b * seq_len / s * cfg.d_model * rho(t),
      'sequence': (M * cfg.n_layers * b * seq_len * cfg.n_kv_heads / t * cfg.head_dim * rho(s)
                   * ((6 if full else 4) * c + (2 * r if cfg.context_parallel == 'ring' else 0))),
  }


def ideal_total(*args, **kwargs) -> float:
  return math.fsum(ideal_bytes(*args, **kwargs).values())
