"""Mixture-of-experts feed-forward: a router sends each token to k of E SwiGLU experts, whose
GEMMs run grouped (kernels/grouped_matmul.py), plus optional shared experts every token takes.

Parameters (logical axes; sharding/rules.py):
  router[embed, experts]                 logits in fp32
  router_bias[experts]                   sigmoid router only: moves the choice, not the weights
  w_gate, w_up[experts, embed, mlp], w_down[experts, mlp, embed]
  shared.*                               an MLP of width shared_experts × expert width

Routing is computed on the whole batch as XLA lays it out. The experts run per device
(sharding.per_shard): each device sorts its own tokens' assignments by expert, multiplies them by
its `tensor` share of every expert's weights, and puts them back in token order. The forward and
backward are one custom VJP, so the weights' gradients leave as the dense layers' do: partial
sums in fp32 (config.model.grad_reduce_dtype), reduce-scattered over the FSDP axes.

  x[B_(data,fsdp), L_sequence, D] · W_gate[E, D_(fsdp,sequence), F_tensor] → h[A_sorted, F_tensor]

Dropless by default: every assignment is computed, however uneven the experts' loads. With a
capacity factor c, an expert takes at most ⌈c · t·k / E⌉ of a device's t tokens (GShard's
per-group capacity: the first in token order are kept); the rest are dropped (weight 0) and
counted.
"""

import functools
import math

import flax.core.spmd
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import sharding
from kernels.grouped_matmul import grouped_matmul, grouped_matmul_dw
from model.config import ModelConfig
from model.layers import MLP, constrain, gathered, param, weight

TOKENS = ('batch', 'length')
GATE_UP = ('experts', 'embed', 'mlp')
DOWN = ('experts', 'mlp', 'embed')


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
    rank_A = jnp.arange(A) - (jnp.cumsum(counts_E) - counts_E)[sorted_A]
    order_A = order_A[jnp.argsort(jnp.where(rank_A < cap, sorted_A, n_experts), stable=True)]
    group_sizes_E = jnp.minimum(counts_E, cap)
  inverse_A = jnp.zeros((A,), jnp.int32).at[order_A].set(jnp.arange(A, dtype=jnp.int32))
  return order_A, inverse_A, group_sizes_E


def kept(experts_Tk, n_experts: int, cap: int | None):
  """bool[t, k]: which assignments `dispatch` computes (all, when dropless)."""
  if cap is None:
    return jnp.ones(experts_Tk.shape, bool)
  _, inverse_A, group_sizes_E = dispatch(experts_Tk, n_experts, cap)
  return (inverse_A < group_sizes_E.sum()).reshape(experts_Tk.shape)


def _settings(cfg: ModelConfig):
  """What the experts' custom VJP needs of the config (hashable, a nondiff argument)."""
  return (cfg.experts, cfg.capacity_factor, cfg.expert_matmul, cfg.remat_policy != 'none',
          jnp.dtype(cfg.compute_dtype).name)


def _local_forward(settings, x_tD, experts_tk, weights_tk, wg, wu, wd):
  """One device's experts: (y_tD, partial over `tensor`; and gate, up [A, F] for the backward)."""
  n_experts, factor, impl, _, _ = settings
  t, k = experts_tk.shape
  order_A, inverse_A, sizes_E = dispatch(experts_tk, n_experts,
                                         capacity(t, k, n_experts, factor))
  xs_AD = x_tD[order_A // k]
  gate_AF = grouped_matmul(xs_AD, wg, sizes_E, implementation=impl)
  up_AF = grouped_matmul(xs_AD, wu, sizes_E, implementation=impl)
  ys_AD = grouped_matmul(_hidden(gate_AF, up_AF), wd, sizes_E, implementation=impl)
  kept_tk = (inverse_A < sizes_E.sum()).reshape(t, k)
  y_tkD = ys_AD[inverse_A].reshape(t, k, -1)
  y_tD = jnp.einsum('tkd,tk->td', y_tkD, jnp.where(kept_tk, weights_tk, 0.0),
                    preferred_element_type=jnp.float32)
  return y_tD.astype(x_tD.dtype), gate_AF, up_AF


def _hidden(gate_AF, up_AF):
  """SwiGLU's silu(gate) · up, in fp32 and back (the backward recomputes exactly this)."""
  return (jax.nn.silu(gate_AF.astype(jnp.float32)) * up_AF).astype(gate_AF.dtype)


def _flat(x_BLD):
  return x_BLD.reshape(-1, x_BLD.shape[-1])


def _gathered_weights(ws, dtype):
  return tuple(gathered(w, names, dtype) for w, names in zip(ws, (GATE_UP, GATE_UP, DOWN)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def experts_ffn(settings, rules, x_BLD, experts_BLk, weights_BLk, wg, wu, wd):
  """Σ_j weights[.., j] · expert_{experts[.., j]}(x) [B, L, D] in x's dtype (module docstring);
  wg, wu, wd are the parameters (config.model.grad_reduce_dtype, where they live)."""
  return _experts_fwd(settings, rules, x_BLD, experts_BLk, weights_BLk, wg, wu, wd)[0]


def _run_forward(settings, x_BLD, experts_BLk, weights_BLk, ws_c):
  def local(x_BLD, experts_BLk, weights_BLk, wg, wu, wd):
    b, l, D = x_BLD.shape
    y_tD, gate_AF, up_AF = _local_forward(settings, _flat(x_BLD), experts_BLk.reshape(b * l, -1),
                                          weights_BLk.reshape(b * l, -1), wg, wu, wd)
    # Per-device buffers travel as [b, l·k, F], so their global shape shards as the tokens do.
    as_tokens = lambda a_AF: a_AF.reshape(b, -1, a_AF.shape[-1])
    return y_tD.reshape(1, b, l, D), as_tokens(gate_AF), as_tokens(up_AF)

  sorted_names = TOKENS + ('mlp',)
  y_PBLD, gate, up = sharding.per_shard(
      local, (TOKENS + ('embed',), TOKENS + (None,), TOKENS + (None,), GATE_UP, GATE_UP, DOWN),
      [('mlp',) + TOKENS + ('embed',), sorted_names, sorted_names])(
          x_BLD, experts_BLk, weights_BLk, *ws_c)
  # The `tensor` shares' partial sums (a row-parallel product's), summed by XLA.
  return y_PBLD.sum(axis=0), gate, up


def _experts_fwd(settings, rules, x_BLD, experts_BLk, weights_BLk, wg, wu, wd):
  keep_weights, dtype = settings[3], settings[4]
  ws_c = _gathered_weights((wg, wu, wd), dtype)
  y_BLD, gate, up = _run_forward(settings, x_BLD, experts_BLk, weights_BLk, ws_c)
  # With a remat policy the layer's forward runs again before its backward, gathering the
  # weights then: keep that gather. Without, gather again rather than hold every layer's.
  kept_ws = ws_c if keep_weights else None
  return y_BLD, (x_BLD, experts_BLk, weights_BLk, (wg, wu, wd), kept_ws, gate, up)


def _experts_bwd(settings, rules, residuals, g_BLD):
  with nnx.logical_axis_rules(rules):
    return _experts_grads(settings, residuals, g_BLD)


def _experts_grads(settings, residuals, g_BLD):
  x_BLD, experts_BLk, weights_BLk, ws, ws_c, gate, up = residuals
  n_experts, factor, impl, _, dtype = settings
  if ws_c is None:
    ws_c = _gathered_weights(ws, dtype)
  _, scatter, summed = sharding.token_gradient_axes('an expert weight')
  reduce_dtype = ws[0].dtype

  def local(x_BLD, experts_BLk, weights_BLk, wg, wu, wd, gate, up, g_BLD):
    b, l, D = x_BLD.shape
    x_tD, g_tD = _flat(x_BLD), _flat(g_BLD).astype(x_BLD.dtype)
    t = x_tD.shape[0]
    experts_tk, weights_tk = experts_BLk.reshape(t, -1), weights_BLk.reshape(t, -1)
    k = experts_tk.shape[1]
    order_A, inverse_A, sizes_E = dispatch(experts_tk, n_experts,
                                           capacity(t, k, n_experts, factor))
    gate_AF, up_AF = gate.reshape(t * k, -1), up.reshape(t * k, -1)
    kept_A = inverse_A < sizes_E.sum()
    weight_A = jnp.where(kept_A, weights_tk.reshape(-1), 0.0)[order_A]
    token_A = order_A // k
    mm = functools.partial(grouped_matmul, group_sizes_G=sizes_E, implementation=impl)
    dw = functools.partial(grouped_matmul_dw, group_sizes_G=sizes_E, out_dtype=jnp.float32,
                           implementation=impl)
    # y_a = w_a · h_a Wd: the router weight's gradient is h_a · (g_t Wdᵀ), and h's is w_a times it.
    gu_AF = mm(g_tD[token_A], jnp.swapaxes(wd, 1, 2))
    sig_AF = jax.nn.sigmoid(gate_AF.astype(jnp.float32))
    silu_AF = jax.nn.silu(gate_AF.astype(jnp.float32))
    h_AF = _hidden(gate_AF, up_AF)
    d_weight_A = jnp.einsum('af,af->a', h_AF, gu_AF, preferred_element_type=jnp.float32)
    dh_AF = gu_AF.astype(jnp.float32) * weight_A[:, None]
    d_gate_AF = (dh_AF * up_AF * sig_AF * (1 + gate_AF * (1 - sig_AF))).astype(x_tD.dtype)
    d_up_AF = (dh_AF * silu_AF).astype(x_tD.dtype)
    g_sorted_AD = (g_tD[token_A] * weight_A[:, None]).astype(x_tD.dtype)
    xs_AD = x_tD[token_A]
    dxs_AD = (mm(d_gate_AF, jnp.swapaxes(wg, 1, 2)).astype(jnp.float32)
              + mm(d_up_AF, jnp.swapaxes(wu, 1, 2)))
    dx_tD = dxs_AD[inverse_A].reshape(t, k, D).sum(axis=1)
    d_weights_tk = jnp.where(kept_A, d_weight_A[inverse_A], 0.0).reshape(t, k)
    grads = [dw(xs_AD, d_gate_AF), dw(xs_AD, d_up_AF), dw(h_AF, g_sorted_AD)]
    grads = [_reduce(g.astype(reduce_dtype), dim, scatter, summed)
             for g, dim in zip(grads, (1, 1, 2))]
    return (dx_tD.astype(x_tD.dtype).reshape(1, b, l, D),
            d_weights_tk.reshape(1, b, l, k), *grads)

  names_in = (TOKENS + ('embed',), TOKENS + (None,), TOKENS + (None,), GATE_UP, GATE_UP, DOWN,
              TOKENS + ('mlp',), TOKENS + ('mlp',), TOKENS + ('embed',))
  names_out = [('mlp',) + TOKENS + ('embed',), ('mlp',) + TOKENS + (None,),
               sharding.Params(GATE_UP), sharding.Params(GATE_UP), sharding.Params(DOWN)]
  dx_PBLD, d_weights_PBLk, dwg, dwu, dwd = sharding.per_shard(local, names_in, names_out)(
      x_BLD, experts_BLk, weights_BLk, *ws_c, gate, up, g_BLD)
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
    self.router = param(rngs, (D, E), ('embed', 'experts'), dt, D ** -0.5)
    if cfg.router == 'sigmoid':
      self.router_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=('experts',),
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
    y_BLD = experts_ffn(_settings(cfg), rules, x_BLD, experts_BLk, weights_BLk,
                        *(weight(w, cfg) for w in (self.w_gate, self.w_up, self.w_down)))
    stats['dropped'] = self._dropped(experts_BLk)
    if cfg.shared_experts:
      y_BLD = y_BLD + self.shared(x_BLD)
    return checkpoint_name(y_BLD, 'projection'), stats

  def _dropped(self, experts_BLk):
    """The share of assignments over capacity (0 when dropless), each device's own count."""
    cfg = self.cfg
    if not cfg.capacity_factor:
      return jnp.zeros((), jnp.float32)

    def local(experts_BLk):
      b, l, k = experts_BLk.shape
      cap = capacity(b * l, k, cfg.experts, cfg.capacity_factor)
      return ~kept(experts_BLk.reshape(b * l, k), cfg.experts, cap).reshape(b, l, k)

    dropped_BLk = sharding.per_shard(local, (TOKENS + (None,),), TOKENS + (None,))(experts_BLk)
    return jnp.mean(dropped_BLk.astype(jnp.float32))


def balance_step(bias_nE, tokens_per_expert_nE, rate: float):
  """DeepSeek-V3's aux-loss-free update: each expert's bias moves by `rate` toward balance,
  up where it took fewer than its share of the assignments, down where more."""
  return bias_nE + rate * jnp.sign(1.0 / bias_nE.shape[-1] - tokens_per_expert_nE)


def aux_loss(stats: dict, cfg: ModelConfig):
  """The router losses added to the training loss, from the layers' stats (mean over layers)."""
  if not stats:
    return jnp.zeros((), jnp.float32)
  return (cfg.load_balance_loss * stats['load_balance'].mean()
          + cfg.router_z_loss * stats['router_z'].mean())


def metrics(stats: dict) -> dict:
  """A step's router metrics from its layers' stats ({} for a dense model): the means over MoE
  layers of the load-balancing loss (1 when balanced), router z-loss and share of assignments
  dropped; the busiest expert's load against its fair share (max over layers and experts of
  E · f_e: 1 when balanced); and each expert's share of assignments, averaged over layers."""
  if not stats:
    return {}
  f_nE = stats['tokens_per_expert']
  return {'moe_load_balance': stats['load_balance'].mean(),
          'moe_router_z': stats['router_z'].mean(), 'moe_dropped': stats['dropped'].mean(),
          'moe_max_load': f_nE.shape[-1] * f_nE.max(), 'moe_tokens_per_expert': f_nE.mean(0)}
