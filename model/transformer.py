"""The decoder: embedding → scanned stack of blocks → final norm → output head."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import sharding
from model import draft, gradient_sums, head, kv_cache, moe, pipeline
from configs.base import MAX_LOGIT, REMAT_POLICIES, ModelConfig
from model.embedding import lookup
from model.layers import (OUT, ROTATED, MLP, Attention, RMSNorm, constrain, gathered,
                          matmul, param, rope_frequencies, weight)

_policies = jax.checkpoint_policies
_QKV = ('query_proj', 'key_proj', 'value_proj')  # checkpoint_name tags in model/layers.py
_ATTENTION = _QKV + ('attention_out',)
_PROJECTIONS = ('projection', OUT)  # every matmul by a weight: OUT is attention's output projection
# The dots policies keep queries and keys rotated (model/layers.py: ROTATED), as attention takes
# them, rather than rotate the kept projections again in the backward (the same bytes: the
# projections' outputs are then not kept)
_DOTS = _PROJECTIONS + (ROTATED,)


def _offload(names):
  return _policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src='device', offload_dst='pinned_host')


# jax's cuDNN attention (jax.nn.dot_product_attention) is a custom VJP whose forward primitive
# returns the output and the softmax statistics its backward reads; ours tags the same two
# (kernels/flash_attention.py). Saving a named output alone leaves the statistics to recompute,
# so the backward would run the attention forward again.
CUDNN_FORWARD = 'dot_product_attention_fwd_wrapper'


def _with_attention_kernel(policy):
  """`policy`, also keeping the attention kernel's output and softmax statistics (cuDNN's or
  ours), so that the backward pass runs attention's backward alone, not its forward again."""
  def keep(prim, *avals, **params):
    return prim.name == CUDNN_FORWARD or policy(prim, *avals, **params)
  return keep


# What each layer keeps for the backward pass (the rest is recomputed); docs/memory.md has the table.
REMAT = {
    'none': None,  # everything
    'full': _policies.nothing_saveable,  # only the layer's input
    'dots': _policies.save_only_these_names(*_DOTS),  # every projection's output
    'dots_attention': _with_attention_kernel(
        _policies.save_only_these_names(*_DOTS, 'attention_kernel')),
    # As the two above, less the output projection's: the backward redoes that matmul from
    # attention's output (which `dots` recomputes anyway, and `dots_attention` keeps), one
    # [batch, length, embed] array a layer for a matmul a layer.
    'dots_except_out': _policies.save_only_these_names('projection', ROTATED),
    'dots_attention_except_out': _with_attention_kernel(
        _policies.save_only_these_names('projection', ROTATED, 'attention_kernel')),
    'save_qkv_proj': _policies.save_only_these_names(*_QKV),
    'save_attention': _with_attention_kernel(
        _policies.save_only_these_names(*_ATTENTION, 'attention_kernel')),
    'offload_dots': _offload(_PROJECTIONS),
    'offload_qkv_proj': _offload(_QKV),
    'offload_attention': _offload(_ATTENTION),
}
assert tuple(REMAT) == REMAT_POLICIES


def layer_kinds(cfg: ModelConfig, first: int = 0, n: int | None = None):
  """What layers first … first + n − 1 attend with: {'window', 'rope'}, one for all of them
  where they are alike (the window an int, or None for global layers; RoPE's inverse
  frequencies), else stacked [n] and [n, head_dim/2] for the scan to hand each layer its own
  (window 0: global)."""
  local = cfg.local_layers[first:first + (cfg.n_layers if n is None else n)]
  if cfg.windows != 'mixed' or len(set(local)) == 1:
    return {'window': cfg.sliding_window if local[0] else None,
            'rope': rope_frequencies(cfg, local[0])}
  return {'window': jnp.asarray([cfg.sliding_window if l else 0 for l in local], jnp.int32),
          'rope': jnp.asarray(np.stack([rope_frequencies(cfg, l) for l in local]))}


def _period(local) -> int:
  """The length of the repeating group of a stack's layers' kinds (local or global): 1 where
  they are alike."""
  return next(p for p in range(1, len(local) + 1)
              if all(local[i] == local[i % p] for i in range(len(local))))


def stacked(kind: dict) -> bool:
  """Whether layer_kinds gave one kind a layer (scanned with the layers) rather than one for all."""
  return isinstance(kind['rope'], jax.Array) and kind['rope'].ndim == 2


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)), the MLP dense or routed
  experts (model/moe.py); with cfg.post_norms (Gemma's) each output normed again before its
  residual add. Returns (x, the experts' balance_stats; {} for a dense block), with cfg.qk_clip
  and each head's largest log-sum-exp of its scores this step (MAX_LOGIT: QK-clip's measure)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, experts: bool = False):
    self.attn_norm = RMSNorm(cfg, rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg, rngs)
    self.mlp = moe.MoE(cfg, rngs) if experts else MLP(cfg, rngs)
    if cfg.post_norms:
      self.attn_post_norm, self.mlp_post_norm = RMSNorm(cfg, rngs), RMSNorm(cfg, rngs)

  def _mlp(self, x_BLD):
    out = self.mlp(self.mlp_norm(x_BLD))
    out, stats = out if isinstance(out, tuple) else (out, {})
    return (self.mlp_post_norm(out) if hasattr(self, 'mlp_post_norm') else out), stats

  def _attn_out(self, out_BLD):
    return self.attn_post_norm(out_BLD) if hasattr(self, 'attn_post_norm') else out_BLD

  def decode(self, x_BTD, positions_BT, cache: dict, layer, weights: dict, kind: dict):
    """The block on T new tokens against its layer of the cache (Attention.decode)."""
    out_BTD, cache = self.attn.decode(self.attn_norm(x_BTD), positions_BT, cache, layer,
                                      weights, kind)
    x_BTD = x_BTD + self._attn_out(out_BTD)
    return x_BTD + self._mlp(x_BTD)[0], cache

  def __call__(self, x_BLD, positions_BL, segment_ids_BL, kind: dict):
    """`kind`: the layer's window and RoPE (layer_kinds)."""
    out_BLD = self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL, kind)
    out_BLD, logits = out_BLD if isinstance(out_BLD, tuple) else (out_BLD, None)
    x_BLD = constrain(x_BLD + self._attn_out(out_BLD), ('batch', 'length', 'embed'))
    out_BLD, stats = self._mlp(x_BLD)
    if logits is not None:
      stats = {**stats, MAX_LOGIT: logits}
    return constrain(x_BLD + out_BLD, ('batch', 'length', 'embed')), stats


def _stack(make, n: int, loops: int, rngs: nnx.Rngs):
  """n layers made by `make(rngs)`, parameters stacked [n, ...] (logical 'layers'), or
  [V, n/V, ...] with V = loops > 1 pipeline chunks ('virtual')."""
  make = nnx.vmap(make, in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  if loops > 1:  # the same layers (same keys, in order) stacked [V, n/V, ...]
    make = nnx.vmap(make, in_axes=0, out_axes=0,
                    transform_metadata={nnx.PARTITION_NAME: 'virtual'})
  return make(rngs.split(n if loops == 1 else (loops, n // loops)))


@dataclasses.dataclass(frozen=True)
class Output:
  """A forward's last hidden states, and how the model turns them into predictions: what a loss
  reads (training/step.py computes it), handed over where the states are (under pipeline stages,
  each stage's share of the microbatches)."""
  model: 'Transformer'
  x_BLD: jax.Array  # the last block's output, before the final norm
  tables: tuple  # the embedding table as the lookup used it: (parameter, gathered compute copy)
  stage_axis: str | None  # inside a pipeline stage: the head's weight gradient crosses stages

  def token_losses(self, targets_BL):
    """(−log p(target), log Z), fp32 [B, L]: final norm, head and loss as one operation that
    never holds the whole logits (model/head.py)."""
    nll_BL, logz_BL = self.model._losses(self.x_BLD, *self.tables, targets_BL, self.stage_axis)
    if self.stage_axis is None:
      return constrain(nll_BL, ('batch', 'length')), constrain(logz_BL, ('batch', 'length'))
    return nll_BL, logz_BL

  def loss_sums(self, targets_BL, weights_BL, z_loss: float):
    """(Σ w·(nll + z_loss·log Z²), Σ w·nll, Σ w·log Z²) over the weighted tokens, fp32: final
    norm, head and loss as one operation, whose gradient the chunked head makes in the same pass
    (model/head.py: loss_sums). The first is the loss; the other two its parts, for metrics."""
    return self.model._loss_sums(self.x_BLD, *self.tables, targets_BL, weights_BL, z_loss,
                                 self.stage_axis)

  def draft_losses(self, targets_BL):
    """The draft heads' (nll, gap) [K, B, L] (draft.Heads.losses), through the base's embedding
    and head, neither of which their gradients reach."""
    return self.model._draft_losses(self.x_BLD, *self.tables, targets_BL)


class Transformer(nnx.Module):
  """Llama-style decoder. Parameters (logical axes → mesh via sharding/rules.py):

    embed[vocab, embed]; blocks.*[layers, ...] (one stacked copy per layer, scanned), or
    blocks.*[virtual, layers, ...] with cfg.virtual_stages > 1 (layer v·n/V + j at [v, j]: the
    pipeline's chunks, model/pipeline.py); final_norm.scale[norm]; unembed[embed, vocab] unless
    cfg.tie_embeddings; draft.*[draft, ...] with cfg.draft_heads (model/draft.py), made last so
    that the base's parameters are drawn as without them.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # Rows of unit-scale entries; a tied table is also the head, which multiplies by it with no
    # scale (as transformers' Llama does): there rows of norm 1 give logits of unit scale at init.
    self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'), cfg.weight_dtype,
                       cfg.d_model ** -0.5 if cfg.tie_embeddings else 1.0)

    if cfg.experts and cfg.dense_layers:  # the first layers keep a dense MLP: a stack of their own
      self.dense_blocks = _stack(lambda r: Block(cfg, r), cfg.dense_layers, 1, rngs)
    self.blocks = _stack(lambda r: Block(cfg, r, experts=cfg.experts > 0),
                         cfg.n_layers - (cfg.dense_layers if cfg.experts else 0),
                         cfg.virtual_stages, rngs)
    self.final_norm = RMSNorm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'),
                           cfg.weight_dtype, cfg.d_model ** -0.5)
    if cfg.draft_heads:
      self.draft = draft.Heads(cfg, rngs)

  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, microbatches: int = 1,
               *, then=None, rows=None):
    """Logits[B, L, V] in fp32; or, with `then`, what then(Output, rows) makes of the last hidden
    states (under pipeline stages, a loss's sums: training/step.py; outside them a loss reads
    `output`'s Output), `rows` a pytree of [B, L] arrays (the targets, the
    weights) laid out as the states are, with the MoE layers' router statistics (model/moe.py:
    balance_stats, each [moe_layers, ...] in execution order; {} for a dense model). Under
    pipeline stages each stage runs `then` on its share of the microbatches, and the stages'
    results are summed: they must be sums. Positions default to 0..L-1; with segment ids (packed
    rows) a token attends only within its own segment, so documents never see each other. Under
    ring attention over a sequence split, rows come in the zigzag order
    (training.step.context_layout lays a batch out so; positions then must be given). With the
    layers split into pipeline stages, the batch flows through them as `microbatches` slices
    (model/pipeline.py)."""
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    if (stage_axis := sharding.mesh_axis('layers')) is None:
      return self._forward(tokens_BL, positions_BL, segment_ids_BL, then, rows)
    # Pipeline stages: every stage runs the whole forward on its own share of the layers.
    graphdef, blocks, rest = nnx.split(self, nnx.PathContains('blocks'), ...)

    def forward(blocks, rest, tokens_BL, positions_BL, segment_ids_BL, rows):
      return nnx.merge(graphdef, blocks, rest)._forward(
          tokens_BL, positions_BL, segment_ids_BL, then, rows, microbatches, stage_axis)

    staged_dim = int(self.cfg.virtual_stages > 1)  # the 'layers' dimension
    return sharding.per_stage(forward, stage_axis, staged_dim)(
        blocks, rest, tokens_BL, positions_BL, segment_ids_BL, rows)

  def output(self, tokens_BL, positions_BL=None, segment_ids_BL=None, sums=None):
    """(Output, the MoE layers' router statistics) of a forward outside pipeline stages: the
    last hidden states and how the model turns them into predictions, which a loss reads
    (training/step.py). `sums`: {stack name: running gradient sums of its trained parameters},
    which the backward adds each layer's gradient into (model/gradient_sums.py: the gradient of
    `sums` is then the new sums; the stacks' own parameters get none). Under stages a loss goes in as __call__'s `then`,
    each stage running it on its share."""
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    assert sharding.mesh_axis('layers') is None, 'under pipeline stages: __call__(then=…)'
    return self._forward(tokens_BL, positions_BL, segment_ids_BL, lambda out, _: out, sums=sums)

  def _forward(self, tokens_BL, positions_BL, segment_ids_BL, then=None, rows=None,
               microbatches=1, stage_axis=None, sums=None):
    cfg = self.cfg
    # The table is gathered (FSDP) once, in the compute dtype: for the lookup, and for a tied
    # head, which keeps it for its backward.
    table_VD = weight(self.embed, cfg)
    table_c_VD = gathered(table_VD, ('vocab', 'embed'), cfg.dtype)
    x_BLD = self._scaled(lookup(table_VD, table_c_VD, tokens_BL))
    x_BLD = constrain(x_BLD, ('batch', 'length', 'embed'))
    if stage_axis is None:
      x_BLD, stats = self._run_blocks(x_BLD, positions_BL, segment_ids_BL, sums or {})
    else:
      y_MbLD, stats = self._run_stages(x_BLD, positions_BL, segment_ids_BL, microbatches,
                                       stage_axis)
      if then is not None:  # each stage its share of the microbatches, none the whole batch
        x_bLD, rows = self._shares(y_MbLD, rows, stage_axis)
        out = then(Output(self, x_bLD, (table_VD, table_c_VD), stage_axis), rows)
        return jax.lax.psum(out, stage_axis), stats
      x_BLD = pipeline.merge(pipeline.to_every_stage(y_MbLD, stage_axis))
      x_BLD = constrain(x_BLD, ('batch', 'length', 'embed'))
    if then is None:
      return constrain(self._head(x_BLD, table_VD, table_c_VD), ('batch', 'length', 'vocab'))
    return then(Output(self, x_BLD, (table_VD, table_c_VD), None), rows), stats

  def _scaled(self, x_BLD):
    """The embedding's rows as the blocks take them: × √d_model with cfg.embed_scale (Gemma's,
    the factor rounded to the rows' dtype as transformers rounds it)."""
    if not self.cfg.embed_scale:
      return x_BLD
    return x_BLD * jnp.asarray(self.cfg.d_model ** 0.5, x_BLD.dtype)

  def _draft_losses(self, x_BLD, table_VD, table_c_VD, targets_BL):
    """The draft heads' (nll, gap) [K, B, L] on the base's last hidden states, through the base's
    embedding table and head, neither of which their gradients reach."""
    w, w_c = map(jax.lax.stop_gradient, self._head_weight(table_VD, table_c_VD))
    table_c_VD = jax.lax.stop_gradient(table_c_VD)

    def token_losses(x_BLD, targets_BL):
      nll_BL, _, gap_BL = head.token_losses(x_BLD, w, w_c, targets_BL,
                                            tied=self.cfg.tie_embeddings,
                                            chunk=self.cfg.head_chunk, gap=True)
      return nll_BL, gap_BL

    # What speculation keeps is a guess equal to the base's own greedy token, so that token, not
    # the text's, is what each head learns to guess.
    greedy_BL = head.greedy_tokens(self.final_norm(jax.lax.stop_gradient(x_BLD)), w_c,
                                   tied=self.cfg.tie_embeddings, chunk=self.cfg.head_chunk)
    return self.draft.losses(x_BLD, targets_BL, greedy_BL,
                             lambda t_BL: jnp.take(table_c_VD, t_BL, axis=0), token_losses)

  def _shares(self, y_MbLD, rows, stage_axis):
    """This stage's share of the pipeline's result and of `rows` (pipeline.shares: stage s the
    microbatches s·m … s·m + m − 1), as [b, L, …]: the work after the stages (the head and loss)
    split among them, so none runs it on the whole batch; the head's weight gradient is then
    summed over the stages, the one thing of a parameter's to cross them."""
    M = y_MbLD.shape[0]
    x_mbLD = constrain(pipeline.shares(y_MbLD, stage_axis), (None, 'batch', 'length', 'embed'))
    rows = jax.tree.map(
        lambda a_BL: pipeline.merge(pipeline.own_share(pipeline.split(a_BL, M), stage_axis)),
        rows)
    return pipeline.merge(x_mbLD), rows

  def _head_weight(self, table_VD, table_c_VD, stage_axis=None):
    """The output projection as (parameter, gathered in the compute dtype): the tied table, or
    the head's own W[embed, vocab]. With `stage_axis`, each stage's own copy, for a head that
    the stages run on different tokens: its gradient is summed over them, in the parameter's
    dtype (XLA's CPU compiler fails on bf16 sums there)."""
    cfg = self.cfg
    if cfg.tie_embeddings and stage_axis is None:
      return table_VD, table_c_VD  # the lookup's own
    p, names = ((self.embed, ('vocab', 'embed')) if cfg.tie_embeddings else
                (self.unembed, ('embed', 'vocab')))
    value = p[...]
    if stage_axis is not None:
      value = jax.lax.pcast(value, stage_axis, to='varying')
    w = value.astype(cfg.reduce_dtype)
    return w, gathered(w, names, cfg.dtype)

  def _losses(self, x_BLD, table_VD, table_c_VD, targets_BL, stage_axis=None):
    """Final norm, then the head and loss as one operation (model/head.py)."""
    return head.token_losses(self.final_norm(x_BLD),
                             *self._head_weight(table_VD, table_c_VD, stage_axis), targets_BL,
                             tied=self.cfg.tie_embeddings, chunk=self.cfg.head_chunk)

  def _loss_sums(self, x_BLD, table_VD, table_c_VD, targets_BL, weights_BL, z_loss: float,
                 stage_axis=None):
    """Final norm, then the head and the loss's sums as one operation (model/head.py)."""
    return head.loss_sums(self.final_norm(x_BLD),
                          *self._head_weight(table_VD, table_c_VD, stage_axis), targets_BL,
                          weights_BL, tied=self.cfg.tie_embeddings, chunk=self.cfg.head_chunk,
                          z_loss=z_loss)

  def _head(self, x_BLD, table_VD, table_c_VD, normed: bool = False):
    """Final norm (unless `normed`: a draft head's own norm came first) and output projection:
    logits in fp32. The projection is gathered once, kept from the forward to the backward (they
    follow each other)."""
    w, w_c = self._head_weight(table_VD, table_c_VD)
    spec = 'bld,vd->blv' if self.cfg.tie_embeddings else 'bld,dv->blv'
    return matmul(spec, x_BLD if normed else self.final_norm(x_BLD), w, jnp.float32, w_c)

  def _tables(self):
    table_VD = weight(self.embed, self.cfg)
    return table_VD, table_VD.astype(self.cfg.dtype)

  def logits(self, x_BTD, normed: bool = False):
    """Logits[B, T, V] in fp32 of hidden states (decode_hidden's), or with `normed` of a draft
    head's normed state (model/draft.py)."""
    return self._head(x_BTD, *self._tables(), normed=normed)

  def embedding(self, tokens_BT):
    """The tokens' rows of the embedding table, in the compute dtype."""
    return jnp.take(self._tables()[1], tokens_BT, axis=0)

  def balanced(self, tokens_per_expert_nE, rate: float) -> None:
    """The sigmoid router's biases after one aux-loss-free balancing step (moe.balance_step),
    from the MoE layers' shares of assignments [moe_layers, E] (execution order)."""
    bias = self.blocks.mlp.router_bias
    bias_nE = self._in_order(bias[...])
    bias[...] = moe.balance_step(bias_nE, tokens_per_expert_nE, rate).reshape(bias.shape)

  def init_cache(self, batch: int, slots: int, kind: str = 'full', ahead: int = 0) -> dict:
    """An empty cache of `kind` (model/kv_cache.py: KINDS) for `slots` positions: the global
    layers' entries [layers, B, S, ...], the local layers' rings (room for their window and
    `ahead` positions a later call may refuse: kv_cache.ring_slots) as '..._local'; an X cache
    also holds each layer's constants under 'weights' (kv_cache.x_weights)."""
    cfg = self.cfg
    if kind not in kv_cache.KINDS:
      raise ValueError(f'cache kind {kind!r}: one of {", ".join(kv_cache.KINDS)}')
    n_global, n_local = kv_cache.layers_of_each_kind(cfg)
    cache = kv_cache.empty(cfg, kind, n_global, batch, slots) if n_global else {}
    if n_local:
      ring = kv_cache.ring_slots(cfg, slots, ahead)
      for name, entry in kv_cache.empty(cfg, kind, n_local, batch, ring).items():
        cache[f'{name}_local'] = entry
      cache['positions_local'] = jnp.full((n_local, batch, ring), -1, jnp.int32)
    if kv_cache.is_x_cache(kind):
      per_stack = []
      for stack, _ in self._stacks():
        graphdef, layers = nnx.split(stack)
        per_stack.append(jax.vmap(lambda layer, graphdef=graphdef: kv_cache.x_weights(
            *nnx.merge(graphdef, layer).attn.kv_weights(), cfg.dtype))(self._in_order(layers)))
      cache['weights'] = jax.tree.map(lambda *w: jnp.concatenate(w), *per_stack)
    return cache

  def decode(self, tokens_BT, positions_BT, cache: dict):
    """Logits[B, T, V] of T new tokens per row at `positions_BT`, reading and extending `cache`
    (init_cache) in the slots of those positions; returns (logits, cache). Feeding a prompt and
    then one token at a time gives the logits `__call__` gives the whole sequence (with a full
    cache; a quantized one approximates them)."""
    x_BTD, cache = self.decode_hidden(tokens_BT, positions_BT, cache)
    return self.logits(x_BTD), cache

  def decode_hidden(self, tokens_BT, positions_BT, cache: dict):
    """decode's last hidden states [B, T, D] (before the final norm) instead of its logits."""
    table_VD, table_c_VD = self._tables()
    x_BTD = self._scaled(lookup(table_VD, table_c_VD, tokens_BT))
    weights = cache.get('weights', {})
    stored = {name: entry for name, entry in cache.items() if name != 'weights'}
    local = self.cfg.local_layers
    for stack, first in self._stacks():
      graphdef, layers = nnx.split(stack)
      layers = self._in_order(layers)
      n = jax.tree.leaves(layers)[0].shape[0]
      mine = jax.tree.map(lambda a, first=first, n=n: a[first:first + n], weights)
      # Local and global layers keep caches of different shapes: the scan runs over the repeating
      # group of layers (Gemma 3's five local and one global), each layer of it its own kind.
      period = _period(local[first:first + n])
      groups = n // period

      def group(x_BTD, stored, group_layers, group_weights, g, size, graphdef=graphdef,
                first=first, period=period):
        for j in range(size):
          at = first + j  # its place in the repeating group, the same in every group
          index = (sum(l == local[at] for l in local[:at])
                   + g * sum(l == local[at] for l in local[first:first + period]))
          x_BTD, stored = nnx.merge(graphdef, jax.tree.map(lambda a: a[j], group_layers)).decode(
              x_BTD, positions_BT, stored, index, jax.tree.map(lambda a: a[j], group_weights),
              layer_kinds(self.cfg, at, 1))
        return x_BTD, stored

      # The whole cache is the scan's carry: each layer writes its new tokens into it in place
      # and reads its own slice, so a step moves the cache once rather than copying it per layer.
      def body(carry, group_index_weights, group=group, period=period):
        group_layers, g, group_weights = group_index_weights
        return group(*carry, group_layers, group_weights, g, period), None

      grouped = lambda tree, groups=groups, period=period: jax.tree.map(
          lambda a: a[:groups * period].reshape(groups, period, *a.shape[1:]), tree)
      (x_BTD, stored), _ = jax.lax.scan(body, (x_BTD, stored),
                                        (grouped(layers), jnp.arange(groups), grouped(mine)))
      if n % period:  # the layers after the last whole group
        rest = lambda tree, groups=groups, period=period: jax.tree.map(
            lambda a: a[groups * period:], tree)
        x_BTD, stored = group(x_BTD, stored, rest(layers), rest(mine), groups, n % period)
    cache = dict(stored, weights=weights) if weights else stored
    return x_BTD, cache

  STACKS = ('dense_blocks', 'blocks')  # the stacks' names, in execution order

  def _stacks(self):
    """(stack, index of its first layer) in execution order: the dense first layers, if a
    stack of their own, then `blocks`."""
    if hasattr(self, 'dense_blocks'):
      return [(self.dense_blocks, 0), (self.blocks, self.cfg.dense_layers)]
    return [(self.blocks, 0)]

  def _run_layers(self, layers, x_BLD, extras, chunk=None, stack=None, sums=None, kind=None):
    """The stacked layers in turn, one `lax.scan`, so compile time does not grow with depth
    (`scan_layers=False` unrolls the same scan: same parameters, so checkpoints are shared); with
    `chunk`, row `chunk` of [V, n/(V·P), ...] (a pipeline stage's, model/pipeline.py), each layer
    picked inside its remat region; with `sums`, the scan whose backward adds each layer's
    gradient to them (model/gradient_sums.py); `kind`: the layers' windows and RoPE (layer_kinds;
    one a layer is scanned with them). Returns (x, each layer's router stats, stacked)."""
    graphdef = nnx.graphdef(self.blocks if stack is None else stack)
    kind = layer_kinds(self.cfg) if kind is None else kind
    per_layer = stacked(kind)
    if per_layer and chunk is not None:
      raise ValueError('config.model.sliding_window with global layers among the local ones '
                       '(global_every) under pipeline stages (config.mesh.stage > 1) is not '
                       'built yet; set config.mesh.stage=1')

    def body(x_BLD, layer, extras):
      layer, layer_kind = layer if per_layer else (layer, kind)
      if chunk is not None:  # `layer` is its index
        layer = jax.tree.map(lambda w: pipeline.pick(w, chunk, layer), layers)
      layer = sharding.row_major(layer)  # a layer's slice: no transposed copy of the stack
      return nnx.merge(graphdef, layer)(x_BLD, *extras, layer_kind)

    policy = REMAT[self.cfg.remat_policy]
    if policy is None and chunk is not None:
      policy = pipeline.recompute_picks
    if policy is not None:
      body = jax.checkpoint(body, policy=policy, prevent_cse=not self.cfg.scan_layers)
    unroll = 1 if self.cfg.scan_layers else True
    if per_layer:  # each layer's kind beside its weights (sums still only theirs)
      layers = (layers, kind)
      sums = None if sums is None else [(s,) for s in sums] if isinstance(sums, list) else (sums,)
    if sums is not None:
      return gradient_sums.scan(body, layers, sums, x_BLD, extras, unroll)
    xs = layers if chunk is None else jnp.arange(jax.tree.leaves(layers)[0].shape[1])
    return jax.lax.scan(lambda x_BLD, layer: body(x_BLD, layer, extras), x_BLD, xs,
                        unroll=unroll)

  def _run_blocks(self, x_BLD, positions_BL, segment_ids_BL, sums):
    first, logits = 0, []
    for name in (name for name in self.STACKS if hasattr(self, name)):
      stack = getattr(self, name)
      layers = self._in_order(nnx.state(stack))
      n = jax.tree.leaves(layers)[0].shape[0]
      kind, first = layer_kinds(self.cfg, first, n), first + n
      x_BLD, stats = self._run_layers(layers, x_BLD, (positions_BL, segment_ids_BL), stack=stack,
                                      sums=sums.get(name), kind=kind)
      if MAX_LOGIT in stats:
        logits.append(stats.pop(MAX_LOGIT))
    if logits:  # every layer's, in order: [layers, heads]
      stats = {**stats, MAX_LOGIT: jnp.concatenate(logits)}
    return x_BLD, stats  # the routers': the last stack's, the MoE layers'

  def _run_stages(self, x_BLD, positions_BL, segment_ids_BL, microbatches, stage_axis):
    """The layers split into pipeline stages over `stage_axis`: each stage scans its own,
    microbatch by microbatch (model/pipeline.py). Returns the last stage's y_MbLD (zeros on the
    others) and the layers' router stats, every stage's."""
    x_MbLD = constrain(pipeline.split(x_BLD, microbatches), (None, 'batch', 'length', 'embed'))
    extras_Mb = jax.tree.map(lambda e: pipeline.split(e, microbatches),
                             (positions_BL, segment_ids_BL))
    return pipeline.schedule(self._run_layers, nnx.state(self.blocks), x_MbLD, extras_Mb,
                             stage_axis, self.cfg.virtual_stages)

  def _in_order(self, layers):
    """Stacked layers as [n, ...] in execution order, from [V, n/V, ...] (neither dimension split:
    a reshape that moves no data)."""
    if self.cfg.virtual_stages == 1:
      return layers
    return jax.tree.map(lambda w: w.reshape(-1, *w.shape[2:]), layers)
