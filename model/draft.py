"""Draft heads: K small heads on the base model's last hidden state that guess the K tokens after
the one the base predicts, for speculative decoding (inference/generate.py: speculate). The base
verifies every guess in one forward, so a guess costs a head's few matmuls, not a forward.

Two kinds (config.model.draft_kind), each head a residual SiLU block of width D on a state s:
  clover (Clover, Xiao et al. 2024, its regressive connection): head k also sees the embedding of
    the token before its target (the true one in training, the one head k−1 guessed when
    decoding), and starts from the state head k−1 left:
      s_0 = h,  s_k = s_{k−1} + SiLU(norm(s_{k−1}) Wh_k + norm(e(x_{t+k})) We_k) Wo_k
  medusa (Medusa, Cai et al. 2024): every head from h alone, s_k = h + SiLU(norm(h) Wh_k) Wo_k.
Head k's logits are out_norm_k(s_k) times the base's own head, and at t it guesses x_{t+k+1}
(the base at t guesses x_{t+1}). Wo starts at zero, so each head starts as the base's head.

Speculation keeps a guess only where it is the token the base itself would pick there, so that
is what a head learns: its target at t is the base's greedy token at t + k (its top guess of
x_{t+k+1} from the text up to x_{t+k}), not the text's x_{t+k+1} (Medusa-2's self-distillation,
with the base's top token: a head that learns the text also learns what the base gets wrong,
and spends its few parameters on it; docs/sampling.md measures both). Its top-1 accuracy is then
how often it agrees with the base, which is what greedy acceptance counts.

The heads learn from the base's hidden states and head without changing them: their losses
reach neither (stop_gradient), so a base trained with heads is the base trained without.

  h[B, L, D], Wh_K and We_K[draft, embed, mlp], Wo_K[draft, mlp, embed], norms[draft, norm]
"""

import jax
import jax.numpy as jnp
from flax import nnx

from configs.base import ModelConfig
from model.layers import Draft, constrain, gathered, param, rms_norm

X = ('batch', 'length', 'embed')


def ahead(a_BL, k: int, fill=0):
  """a_BL moved k places to the left along L, the last k filled with `fill`: a[:, t] becomes
  a[:, t + k]."""
  if k == 0:
    return a_BL
  return jnp.concatenate([a_BL[:, k:], jnp.full((a_BL.shape[0], k), fill, a_BL.dtype)], axis=1)


def weights(weights_BL, segment_ids_BL, heads: int):
  """[K, B, L]: the weight of head k's guess at t, that of the token it guesses (t + k + 1's,
  i.e. the k-th next target's), where that token is in t's document and the row."""
  out = []
  for k in range(1, heads + 1):
    w_BL = ahead(weights_BL, k)
    if segment_ids_BL is not None:
      w_BL = jnp.where(ahead(segment_ids_BL, k, -1) == segment_ids_BL, w_BL, 0)
    out.append(w_BL)
  return jnp.stack(out)


class Heads(nnx.Module):
  """The K draft heads, their parameters stacked [K, ...] (of type Draft)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    K, D, dt = cfg.draft_heads, cfg.d_model, cfg.param_dtype
    self.w_h = param(rngs, (K, D, D), ('draft', 'embed', 'mlp'), dt, D ** -0.5, Draft)
    self.w_o = param(rngs, (K, D, D), ('draft', 'mlp', 'embed'), dt, 0, Draft)
    self.h_norm = param(rngs, (K, D), ('draft', 'norm'), dt, None, Draft)
    self.out_norm = param(rngs, (K, D), ('draft', 'norm'), dt, None, Draft)
    if cfg.draft_kind == 'clover':
      self.w_e = param(rngs, (K, D, D), ('draft', 'embed', 'mlp'), dt, D ** -0.5, Draft)
      self.e_norm = param(rngs, (K, D), ('draft', 'norm'), dt, None, Draft)

  def _weight(self, p, k, names):
    return gathered(p[...][k], names, self.cfg.dtype)

  def step(self, k: int, h_D, s_D, e_D=None):
    """Head k's state (0-based) from the base's h, the state s head k−1 left (h for the first)
    and, for clover, the embedding e of the token before the one it guesses; every array
    [..., D] in the compute dtype. Returns (s_k, out_norm_k(s_k): what the base's head takes)."""
    dtype = self.cfg.dtype
    start_D = s_D if self.cfg.draft_kind == 'clover' else h_D
    norm = lambda x_D, p: rms_norm(x_D, p[...][k], self.cfg.norm_eps)
    pre_F = jnp.einsum('...d,df->...f', norm(start_D, self.h_norm),
                       self._weight(self.w_h, k, ('embed', 'mlp')))
    if self.cfg.draft_kind == 'clover':
      pre_F = pre_F + jnp.einsum('...d,df->...f', norm(e_D, self.e_norm),
                                 self._weight(self.w_e, k, ('embed', 'mlp')))
    s_D = start_D + jnp.einsum('...f,fd->...d', jax.nn.silu(pre_F).astype(dtype),
                               self._weight(self.w_o, k, ('mlp', 'embed')))
    return s_D, norm(s_D, self.out_norm)

  def losses(self, h_BLD, targets_BL, greedy_BL, embed, token_losses):
    """(−log p, gap to the top logit) [K, B, L] fp32 of head k's guess at every t of the base's
    own greedy token k + 1 places on, from the base's last hidden states h (what its head takes,
    before the final norm). Clover's heads see the text's tokens before their target
    (`targets_BL`); `greedy_BL` [B, L] is the base's top token at each position (the targets'
    own positions), what speculation checks a guess against. `embed(tokens_BL)` gives the base's
    embeddings and `token_losses(x_BLD, targets_BL)` its head's (nll, gap), both without
    gradients to the base. Head k's entries past the row's end are garbage: `weights` gives them
    weight 0."""
    h_BLD = jax.lax.stop_gradient(h_BLD).astype(self.cfg.dtype)
    s_BLD, nll, gap = h_BLD, [], []
    for k in range(self.cfg.draft_heads):
      e_BLD = (constrain(embed(ahead(targets_BL, k)), X) if self.cfg.draft_kind == 'clover'
               else None)
      s_BLD, out_BLD = self.step(k, h_BLD, s_BLD, e_BLD)
      s_BLD = constrain(s_BLD, X)
      nll_BL, gap_BL = token_losses(constrain(out_BLD, X), ahead(greedy_BL, k + 1))
      nll.append(nll_BL)
      gap.append(gap_BL)
    return jnp.stack(nll), jnp.stack(gap)

  def propose(self, h_BD, token_B, embed, logits, choose):
    """K guesses [B, K] of the tokens after `token_B` (the base's next token, drawn from its
    logits at h), and what `choose(logits_BV, k)` returned beside each (its distribution, or
    None when greedy): choose(logits, k) → (token_B, probs). Clover's head k sees the token
    head k−1 chose; Medusa's heads each see h alone."""
    s_BD, tokens, probs = h_BD, [], []
    previous_B = token_B
    for k in range(self.cfg.draft_heads):
      e_BD = embed(previous_B) if self.cfg.draft_kind == 'clover' else None
      s_BD, out_BD = self.step(k, h_BD, s_BD, e_BD)
      previous_B, p = choose(logits(out_BD), k)
      tokens.append(previous_B)
      probs.append(p)
    return jnp.stack(tokens, axis=1), probs
