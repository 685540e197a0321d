"""Mixture-of-experts feed-forward: a router sends each token to k of E SwiGLU experts, whose
GEMMs run grouped (kernels/grouped_matmul.py), plus optional shared experts every token takes.

Parameters (logical axes; sharding/rules.py):
  router[embed, expert_scores]           logits in fp32 (every token's device needs all E)
  router_bias[expert_scores]             sigmoid router only: moves the choice, not the weights
  w_gate, w_up[experts, expert_embed, mlp], w_down[experts, expert_mlp, expert_out]
                                         (w_down's FSDP share on its width: sharding/rules.py)
  shared.*                               an MLP of width shared_experts × expert width

Routing is computed on the whole batch as XLA lays it out. The experts run per device
(sharding.per_shard): each device sorts its own tokens' A = t·k assignments by expert, multiplies
them by its `tensor` share of its experts' weights, and puts them back in token order. With an
`expert` mesh axis of P devices each holds E/P experts: the sorted rows go to their experts'
devices by all-to-all and come back the same way (kernels/all_to_all.py), forward and backward.
The forward and backward are one custom VJP, so the weights' gradients leave as the dense
layers' do: partial sums in the reduction dtype (config.model.grad_reduce_dtype), reduce-scattered
over the FSDP axes; over `expert` each gradient is already whole, as its tokens came to it.

  x[B_(data,fsdp,expert), L_sequence, D] → rows[A, D] → (all-to-all over expert) → [R, D]
      · W_gate[E_expert, D_(fsdp,sequence), F_tensor] → h[R, F_tensor]

Dropless by default: every assignment is computed, however uneven the experts' loads. With a
capacity factor c, an expert takes at most ⌈c · t·k / E⌉ of a device's t tokens (GShard's
per-group capacity: the first in token order are kept); the rest are dropped (weight 0) and
counted. The experts' side of an all-to-all holds R rows: the worst case by default, so nothing
is lost (P·t·min(k, E_l) when dropless, E_l experts a device: a token's k experts are distinct), or
config.model.expert_buffer × A, where the rows past it are dropped and counted too.
"""

import functools
import math
from typing import NamedTuple

import flax.core.spmd
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import sharding
from kernels.all_to_all import exchange, exclusive_cumsum
from kernels.grouped_matmul import grouped_matmul, grouped_matmul_dw
from configs.base import ModelConfig
from model.layers import MLP, constrain, gathered, param, weight

TOKENS = ('batch', 'length')
GATE_UP = ('experts', 'expert_embed', 'mlp')
DOWN = ('experts', 'expert_mlp', 'expert_out')


class RouterBias(nnx.Param):
  """The sigmoid router's balancing bias: added to the scores only to choose experts, so no
  gradient reaches it; the train step moves it toward balance (`balance_step`), and it takes no
  weight decay."""


def route(logits_TE, bias_E, k: int, router: str, renormalize: bool):
  """(weights[T, k], experts[T, k], probs[T, E]) from fp32 router logits: the top-k of the
  softmax (softmax), or of sigmoid scores plus the balancing bias, weighted by the scores alone
  (sigmoid, DeepSeek-V3); `probs` are what the load-balancing loss averages (the softmax, or the
  scores normalised to sum to 1)."""
  if router == 'softmax':
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    weights_Tk, experts_Tk = jax.lax.top_k(probs_TE, k)
  else:
    scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E
    experts_Tk = jax.lax.top_k(choice_TE, k)[1]
    weights_Tk = jnp.take_along_axis(scores_TE, experts_Tk, axis=-1)
    probs_TE = scores_TE / scores_TE.sum(axis=-1, keepdims=True)
  if renormalize:
    weights_Tk = weights_Tk / weights_Tk.sum(axis=-1, keepdims=True)
  return weights_Tk, experts_Tk, probs_TE


def balance_stats(logits_TE, probs_TE, experts_Tk) -> dict:
  """A layer's router statistics over its tokens, fp32:
    tokens_per_expert[E]  f_e, the share of the t·k assignments that chose expert e (sums to 1)
    load_balance          E · Σ_e f_e · P_e, P_e the mean of probs over tokens (Switch
                          Transformer's loss at k = 1; 1 when balanced; transformers' Mixtral
                          loss is k times this)
    router_z              mean over tokens of logsumexp(logits)² (ST-MoE's router z-loss)
  f has no gradient (counts); the loss pushes the probabilities of busy experts down."""
  E = logits_TE.shape[-1]
  f_E = jax.nn.one_hot(experts_Tk, E, dtype=jnp.float32).sum(axis=(0, 1)) / experts_Tk.size
  p_E = probs_TE.mean(axis=0)
  return {'tokens_per_expert': f_E, 'load_balance': E * jnp.sum(f_E * p_E),
          'router_z': jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))}


def capacity(tokens: int, k: int, experts: int, factor: float) -> int | None:
  """Assignments an expert takes of a device's `tokens`; None: all (dropless)."""
  return None if factor == 0 else max(1, math.ceil(factor * tokens * k / experts))


def dispatch(experts_Tk, n_experts: int, cap: int | None):
  """(order[A], inverse[A], group_sizes[E]) for the A = t·k assignments, a = t·k + j: `order`
  lists them sorted by expert (stably, so in token order within an expert), with those over
  capacity after all the kept; inverse[a] is a's row in that order; rows ≥ Σ group_sizes are
  the dropped."""
  expert_A = experts_Tk.reshape(-1)
  A = expert_A.shape[0]
  order_A = jnp.argsort(expert_A, stable=True)
  counts_E = jnp.zeros((n_experts,), jnp.int32).at[expert_A].add(1)
  group_sizes_E = counts_E
  if cap is not None:
    sorted_A = expert_A[order_A]
    rank_A = jnp.arange(A) - exclusive_cumsum(counts_E)[sorted_A]
    order_A = order_A[jnp.argsort(jnp.where(rank_A < cap, sorted_A, n_experts), stable=True)]
    group_sizes_E = jnp.minimum(counts_E, cap)
  inverse_A = jnp.zeros((A,), jnp.int32).at[order_A].set(jnp.arange(A, dtype=jnp.int32))
  return order_A, inverse_A, group_sizes_E


def _settings(cfg: ModelConfig):
  """What the experts' custom VJP needs of the config (hashable, a nondiff argument)."""
  return (cfg.experts, cfg.capacity_factor, cfg.expert_matmul, cfg.remat_policy != 'none',
          jnp.dtype(cfg.compute_dtype).name, cfg.expert_buffer)


class Routes(NamedTuple):
  """How one device's assignments, sorted by expert, reach their experts' devices along the
  `expert` mesh axis and come back (kernels/all_to_all.py), and how the rows received are
  ordered for the local experts' grouped matmuls. Without an expert axis every expert is local
  and the rows stay where they are."""
  axis: str | None
  kept_A: jax.Array  # which sorted assignments are computed: within capacity, and taken
  send_P: jax.Array | None  # rows to each device of the axis
  offsets_P: jax.Array | None  # where each device's rows start among the sorted
  recv_P: jax.Array | None  # rows from each
  order_R: jax.Array | None  # received rows (by source, then expert) sorted by local expert
  inverse_R: jax.Array | None
  sizes_e: jax.Array  # the local experts' group sizes
  rows: int  # R, the expert side's buffer
  chunk: int  # the most rows one device sends another

  @property
  def filled(self) -> float:
    """The share of the buffer balanced experts fill: each device takes in as many rows as it
    sends, all its assignments (the time model's expectation of the grouped matmuls' work)."""
    return min(1.0, self.kept_A.shape[0] / self.rows)


def routes(sorted_A, sizes_E, axis: str | None, cap: int | None, buffer: float,
           rows_multiple: int, per_token: int):
  """Routes for a device whose assignments (`per_token` a token), in dispatch's order, chose
  experts `sorted_A`, `sizes_E` of them kept for each expert. The expert side's buffer holds R
  rows, rounded up to a multiple of `rows_multiple`: the worst case when `buffer` is 0, so none is
  lost (P·t·min(k, E_l) when dropless: a token's k experts are distinct, so it sends a device of
  E_l experts at most min(k, E_l) rows; P·E_l·cap with a capacity, if fewer); else `buffer` × A,
  A being what each device receives on
  average when the experts are balanced. A device fills its buffer with its sources' rows in
  source order, each source's in expert order, and drops those past R: the later sources' and,
  of a source's, the later experts'."""
  A = sorted_A.shape[0]
  if axis is None:
    kept_A = jnp.arange(A) < sizes_E.sum()
    return Routes(None, kept_A, None, None, None, None, None, sizes_E, A, A)
  P = jax.lax.axis_size(axis)
  E_l = sizes_E.shape[0] // P
  most = A // per_token * min(per_token, E_l)  # the most rows one source sends one device
  chunk = most if cap is None else min(most, E_l * cap)
  R = P * chunk if not buffer else min(P * chunk, math.ceil(buffer * A))
  R = -(-R // rows_multiple) * rows_multiple
  sent_PE = sizes_E.reshape(P, E_l)
  got_PE = jax.lax.all_to_all(sent_PE, axis, 0, 0, tiled=True)  # [source, local expert]
  if R < P * chunk:  # what fits of each source's rows, a prefix in expert order; told back
    room_P = jnp.clip(R - exclusive_cumsum(got_PE.sum(1)), 0, None)
    got_PE = jnp.clip(room_P[:, None] - exclusive_cumsum(got_PE, axis=1), 0, got_PE)
    taken_E = jax.lax.all_to_all(got_PE, axis, 0, 0, tiled=True).reshape(-1)
  else:
    taken_E = sizes_E
  rank_A = jnp.arange(A) - exclusive_cumsum(sizes_E)[sorted_A]  # within its expert's rows
  kept_A = (jnp.arange(A) < sizes_E.sum()) & (rank_A < taken_E[sorted_A])
  segment_R = jnp.searchsorted(jnp.cumsum(got_PE.reshape(-1)), jnp.arange(R), side='right')
  expert_R = jnp.where(segment_R < P * E_l, segment_R % E_l, E_l)
  order_R = jnp.argsort(expert_R, stable=True)
  inverse_R = jnp.zeros((R,), jnp.int32).at[order_R].set(jnp.arange(R, dtype=jnp.int32))
  return Routes(axis, kept_A, taken_E.reshape(P, E_l).sum(1), exclusive_cumsum(sent_PE.sum(1)),
                got_PE.sum(1), order_R, inverse_R, got_PE.sum(0), R, chunk)


def to_experts(rows_AD, r: Routes):
  """A device's sorted assignment rows → the rows its local experts take, sorted by expert."""
  if r.axis is None:
    return rows_AD
  return exchange(rows_AD, r.send_P, r.recv_P, r.rows, r.axis, r.chunk,
                  in_offsets_P=r.offsets_P)[r.order_R]


def from_experts(rows_RD, r: Routes, assignments: int):
  """The inverse of to_experts: each row back to the device and sorted place it came from (the
  rows not taken, zeros)."""
  if r.axis is None:
    return rows_RD
  return exchange(rows_RD[r.inverse_R], r.recv_P, r.send_P, assignments, r.axis, r.chunk,
                  out_offsets_P=r.offsets_P)


def _local_routes(settings, axis, experts_tk, b: int):
  """(order[A], inverse[A], Routes) for one device's tokens."""
  n_experts, factor, buffer = settings[0], settings[1], settings[5]
  t, k = experts_tk.shape
  cap = capacity(t, k, n_experts, factor)
  order_A, inverse_A, sizes_E = dispatch(experts_tk, n_experts, cap)
  return order_A, inverse_A, routes(experts_tk.reshape(-1)[order_A], sizes_E, axis, cap, buffer,
                                    b, k)


def _hidden(gate_AF, up_AF):
  """SwiGLU's silu(gate) · up, in fp32 and back (the backward recomputes exactly this)."""
  return (jax.nn.silu(gate_AF.astype(jnp.float32)) * up_AF).astype(gate_AF.dtype)


def _flat(x_BLD):
  return x_BLD.reshape(-1, x_BLD.shape[-1])


def _gathered_weights(ws, dtype):
  return tuple(gathered(w, names, dtype) for w, names in zip(ws, (GATE_UP, GATE_UP, DOWN)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def experts_ffn(settings, rules, x_BLD, experts_BLk, weights_BLk, wg, wu, wd):
  """(Σ_j weights[.., j] · expert_{experts[.., j]}(x) [B, L, D] in x's dtype, and which
  assignments were dropped bool[B, L, k]) (module docstring); wg, wu, wd are the parameters
  (in the reduction dtype, config.model.grad_reduce_dtype, where they live)."""
  return _experts_fwd(settings, rules, x_BLD, experts_BLk, weights_BLk, wg, wu, wd)[0]


# Per-device buffers travel out of sharding.per_shard as [b, rows/b, ·], so their global shapes
# shard as the tokens do: the sorted assignments (A = b·l·k rows) and the expert side's (R rows).
SORTED = TOKENS + ('embed',)
EXPERT_SIDE = TOKENS + ('mlp',)


def _run_forward(settings, x_BLD, experts_BLk, weights_BLk, ws_c):
  impl, axis = settings[2], sharding.mesh_axis('experts')

  def local(x_BLD, experts_BLk, weights_BLk, wg, wu, wd):
    b, l, D = x_BLD.shape
    x_tD, experts_tk = _flat(x_BLD), experts_BLk.reshape(b * l, -1)
    t, k = experts_tk.shape
    order_A, inverse_A, r = _local_routes(settings, axis, experts_tk, b)
    xe_RD = to_experts(x_tD[order_A // k], r)
    mm = functools.partial(grouped_matmul, group_sizes_G=r.sizes_e, implementation=impl,
                           filled=r.filled)
    gate_RF, up_RF = mm(xe_RD, wg), mm(xe_RD, wu)
    ye_RD = mm(_hidden(gate_RF, up_RF), wd)
    ys_AD = from_experts(ye_RD, r, t * k)  # partial over `tensor`, as a row-parallel product
    kept_tk = r.kept_A[inverse_A].reshape(t, k)
    y_tD = jnp.einsum('tkd,tk->td', ys_AD[inverse_A].reshape(t, k, D),
                      jnp.where(kept_tk, weights_BLk.reshape(t, k), 0.0),
                      preferred_element_type=jnp.float32)
    rows = lambda a: a.reshape(b, -1, a.shape[-1])
    # The received rows are kept only where they crossed devices: without an expert axis the
    # backward gathers them from x again.
    xe = rows(xe_RD) if axis else jnp.zeros((b, 0, D), x_tD.dtype)
    return (y_tD.astype(x_tD.dtype).reshape(1, b, l, D), ~kept_tk.reshape(b, l, k),
            rows(ys_AD)[None], xe, rows(gate_RF), rows(up_RF))

  y_PBLD, dropped_BLk, *saved = sharding.per_shard(
      local, (TOKENS + ('embed',), TOKENS + (None,), TOKENS + (None,), GATE_UP, GATE_UP, DOWN),
      [('mlp',) + TOKENS + ('embed',), TOKENS + (None,), ('mlp',) + SORTED, SORTED, EXPERT_SIDE,
       EXPERT_SIDE])(x_BLD, experts_BLk, weights_BLk, *ws_c)
  # The `tensor` shares' partial sums, summed by XLA; the saved outputs stay partial.
  return (y_PBLD.sum(axis=0), dropped_BLk), saved


def _experts_fwd(settings, rules, x_BLD, experts_BLk, weights_BLk, wg, wu, wd):
  keep_weights, dtype = settings[3], settings[4]
  ws_c = _gathered_weights((wg, wu, wd), dtype)
  out, saved = _run_forward(settings, x_BLD, experts_BLk, weights_BLk, ws_c)
  # With a remat policy the layer's forward runs again before its backward, gathering the
  # weights then: keep that gather. Without, gather again rather than hold every layer's.
  kept_ws = ws_c if keep_weights else None
  return out, (x_BLD, experts_BLk, weights_BLk, (wg, wu, wd), kept_ws, *saved)


def _experts_bwd(settings, rules, residuals, cotangents):
  with nnx.logical_axis_rules(rules):
    return _experts_grads(settings, residuals, cotangents[0])


def _experts_grads(settings, residuals, g_BLD):
  x_BLD, experts_BLk, weights_BLk, ws, ws_c, ys, xe, gate, up = residuals
  impl, dtype, axis = settings[2], settings[4], sharding.mesh_axis('experts')
  if ws_c is None:
    ws_c = _gathered_weights(ws, dtype)
  _, scatter, summed = sharding.token_gradient_axes('an expert weight', 'expert_embed', 'experts')
  reduce_dtype = ws[0].dtype

  def local(x_BLD, experts_BLk, weights_BLk, wg, wu, wd, ys, xe, gate, up, g_BLD):
    b, l, D = x_BLD.shape
    x_tD, g_tD = _flat(x_BLD), _flat(g_BLD).astype(x_BLD.dtype)
    experts_tk = experts_BLk.reshape(b * l, -1)
    t, k = experts_tk.shape
    order_A, inverse_A, r = _local_routes(settings, axis, experts_tk, b)
    kept_A = r.kept_A
    token_A = order_A // k
    weight_A = jnp.where(kept_A, weights_BLk.reshape(-1)[order_A], 0.0)
    # y_t = Σ_a w_a · ys_a: the router weight's gradient is ys_a · g_t; the expert's output's
    # is w_a · g_t, which goes to the expert.
    g_AD = g_tD[token_A]
    d_weight_A = jnp.einsum('ad,ad->a', ys.reshape(t * k, D), g_AD,
                            preferred_element_type=jnp.float32)
    ge_RD = to_experts((g_AD * weight_A[:, None]).astype(x_tD.dtype), r)
    xe_RD = xe.reshape(r.rows, D) if axis else x_tD[token_A]
    gate_RF, up_RF = gate.reshape(r.rows, -1), up.reshape(r.rows, -1)
    mm = functools.partial(grouped_matmul, group_sizes_G=r.sizes_e, implementation=impl,
                           filled=r.filled)
    # Written by the kernel in the dtype they are reduced in: its fp32 sums rounded once, as a
    # cast after would round them, without a layer's fp32 [E, D, F] gradients held for it.
    dw = functools.partial(grouped_matmul_dw, group_sizes_G=r.sizes_e, out_dtype=reduce_dtype,
                           implementation=impl, filled=r.filled)
    dh_RF = mm(ge_RD, jnp.swapaxes(wd, 1, 2)).astype(jnp.float32)
    sig_RF = jax.nn.sigmoid(gate_RF.astype(jnp.float32))
    silu_RF = jax.nn.silu(gate_RF.astype(jnp.float32))
    d_gate_RF = (dh_RF * up_RF * sig_RF * (1 + gate_RF * (1 - sig_RF))).astype(x_tD.dtype)
    d_up_RF = (dh_RF * silu_RF).astype(x_tD.dtype)
    dxe_RD = (mm(d_gate_RF, jnp.swapaxes(wg, 1, 2)).astype(jnp.float32)
              + mm(d_up_RF, jnp.swapaxes(wu, 1, 2))).astype(x_tD.dtype)
    grads = [dw(xe_RD, d_gate_RF), dw(xe_RD, d_up_RF), dw(_hidden(gate_RF, up_RF), ge_RD)]
    grads = [_reduce(g.astype(reduce_dtype), dim, scatter, summed)
             for g, dim in zip(grads, (1, 1, 1))]  # each one's FSDP-split dimension
    dxs_AD = from_experts(dxe_RD, r, t * k).astype(jnp.float32)
    dx_tD = dxs_AD[inverse_A].reshape(t, k, D).sum(axis=1)
    d_weights_tk = jnp.where(kept_A, d_weight_A, 0.0)[inverse_A].reshape(t, k)
    return (dx_tD.astype(x_tD.dtype).reshape(1, b, l, D),
            d_weights_tk.reshape(1, b, l, k), *grads)

  names_in = (TOKENS + ('embed',), TOKENS + (None,), TOKENS + (None,), GATE_UP, GATE_UP, DOWN,
              ('mlp',) + SORTED, SORTED, EXPERT_SIDE, EXPERT_SIDE, TOKENS + ('embed',))
  names_out = [('mlp',) + TOKENS + ('embed',), ('mlp',) + TOKENS + (None,),
               sharding.Params(GATE_UP), sharding.Params(GATE_UP), sharding.Params(DOWN)]
  dx_PBLD, d_weights_PBLk, dwg, dwu, dwd = sharding.per_shard(local, names_in, names_out)(
      x_BLD, experts_BLk, weights_BLk, *ws_c, ys, xe, gate, up, g_BLD)
  # Partial over the `tensor` shares of the expert width, as the forward's output is.
  dx_BLD = dx_PBLD.astype(jnp.float32).sum(axis=0).astype(x_BLD.dtype)
  d_weights_BLk = d_weights_PBLk.sum(axis=0)
  grads = tuple(sharding.varying_like(d, w) for d, w in zip((dwg, dwu, dwd), ws))
  return (sharding.varying_like(dx_BLD, x_BLD), None,
          sharding.varying_like(d_weights_BLk, weights_BLk), *grads)


def _reduce(dw, model_dim: int, scatter: tuple, summed: tuple):
  """A device's partial weight gradient summed over every device's tokens: reduce-scattered
  along its model dimension over the axes that also split it (FSDP's), summed over the rest."""
  if scatter:
    dw = jax.lax.psum_scatter(dw, scatter, scatter_dimension=model_dim, tiled=True)
  return jax.lax.psum(dw, summed) if summed else dw


experts_ffn.defvjp(_experts_fwd, _experts_bwd)


class MoE(nnx.Module):
  """Routed SwiGLU experts (module docstring); `__call__` returns (y, balance_stats)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    E, D, F, dt = cfg.experts, cfg.d_model, cfg.expert_width, cfg.weight_dtype
    self.router = param(rngs, (D, E), ('embed', 'expert_scores'), dt, D ** -0.5)
    if cfg.router == 'sigmoid':
      self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=('expert_scores',),
                                    eager_sharding=False)
    self.w_gate = param(rngs, (E, D, F), GATE_UP, dt, D ** -0.5)
    self.w_up = param(rngs, (E, D, F), GATE_UP, dt, D ** -0.5)
    self.w_down = param(rngs, (E, F, D), DOWN, dt, F ** -0.5)
    if cfg.shared_experts:
      self.shared = MLP(cfg, rngs, d_ff=cfg.shared_experts * F)

  def __call__(self, x_BLD):
    cfg = self.cfg
    B, L, _ = x_BLD.shape
    logits_TE = jnp.einsum('td,de->te', _flat(x_BLD).astype(jnp.float32),
                           self.router[...].astype(jnp.float32))
    bias_E = self.router_bias[...] if cfg.router == 'sigmoid' else None
    weights_Tk, experts_Tk, probs_TE = route(logits_TE, bias_E, cfg.experts_per_token,
                                             cfg.router, cfg.router_renormalize)
    stats = balance_stats(logits_TE, probs_TE, experts_Tk)
    experts_BLk = constrain(experts_Tk.reshape(B, L, -1), TOKENS + (None,))
    weights_BLk = constrain(weights_Tk.reshape(B, L, -1), TOKENS + (None,))
    rules = tuple(flax.core.spmd.get_logical_axis_rules())
    y_BLD, dropped_BLk = experts_ffn(
        _settings(cfg), rules, x_BLD, experts_BLk, weights_BLk,
        *(weight(w, cfg) for w in (self.w_gate, self.w_up, self.w_down)))
    stats['dropped'] = jnp.mean(dropped_BLk.astype(jnp.float32))  # over capacity or buffer
    if cfg.shared_experts:
      y_BLD = y_BLD + self.shared(x_BLD)
    return checkpoint_name(y_BLD, 'projection'), stats


def balance_step(bias_nE, tokens_per_expert_nE, rate: float):
  """DeepSeek-V3's aux-loss-free update: each expert's bias moves by `rate` toward balance,
  up where it took fewer than its share of the assignments, down where more."""
  return bias_nE + rate * jnp.sign(1.0 / bias_nE.shape[-1] - tokens_per_expert_nE)


def aux_loss(stats: dict, cfg: ModelConfig):
  """The router losses added to the training loss, from the layers' stats (mean over layers)."""
  if 'load_balance' not in stats:  # a dense model's (QK-clip's measure aside)
    return jnp.zeros((), jnp.float32)
  return (cfg.load_balance_loss * stats['load_balance'].mean()
          + cfg.router_z_loss * stats['router_z'].mean())


def metrics(stats: dict) -> dict:
  """A step's router metrics from its layers' stats ({} for a dense model): the means over MoE
  layers of the load-balancing loss (1 when balanced), router z-loss and share of assignments
  dropped; the busiest expert's load against its fair share (max over layers and experts of
  E · f_e: 1 when balanced); and each expert's share of assignments, averaged over layers."""
  if 'load_balance' not in stats:
    return {}
  f_nE = stats['tokens_per_expert']
  return {'moe_load_balance': stats['load_balance'].mean(),
          'moe_router_z': stats['router_z'].mean(), 'moe_dropped': stats['dropped'].mean(),
          'moe_max_load': f_nE.shape[-1] * f_nE.max(), 'moe_tokens_per_expert': f_nE.mean(0)}
