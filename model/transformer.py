"""The decoder: embedding → scanned stack of blocks → final norm → output head."""

import jax
import jax.numpy as jnp
from flax import nnx

import sharding
from model import pipeline
from model.config import REMAT_POLICIES, ModelConfig
from model.layers import Block, RMSNorm, constrain, gathered, lookup, matmul, param, weight

_policies = jax.checkpoint_policies
_QKV = ('query_proj', 'key_proj', 'value_proj')  # checkpoint_name tags in model/layers.py
_ATTENTION = _QKV + ('attention_out',)


def _offload(names):
  return _policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src='device', offload_dst='pinned_host')


# What each layer keeps for the backward pass (the rest is recomputed); docs/memory.md has the table.
REMAT = {
    'none': None,  # everything
    'full': _policies.nothing_saveable,  # only the layer's input
    'dots': _policies.save_only_these_names('projection'),  # every projection's output
    'save_qkv_proj': _policies.save_only_these_names(*_QKV),
    'save_attention': _policies.save_only_these_names(*_ATTENTION),
    'offload_dots': _offload(('projection',)),
    'offload_qkv_proj': _offload(_QKV),
    'offload_attention': _offload(_ATTENTION),
}
assert tuple(REMAT) == REMAT_POLICIES


class Transformer(nnx.Module):
  """Llama-style decoder. Parameters (logical axes → mesh via sharding/rules.py):

    embed[vocab, embed]; blocks.*[layers, ...] (one stacked copy per layer, scanned), or
    blocks.*[virtual, layers, ...] with cfg.virtual_stages > 1 (layer v·n/V + j at [v, j]: the
    pipeline's chunks, model/pipeline.py); final_norm.scale[norm]; unembed[embed, vocab] unless
    cfg.tie_embeddings.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # Rows of unit-scale entries; a tied table is also the head, which multiplies by it with no
    # scale (as transformers' Llama does): there rows of norm 1 give logits of unit scale at init.
    self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'), cfg.weight_dtype,
                       cfg.d_model ** -0.5 if cfg.tie_embeddings else 1.0)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def make_blocks(rngs):
      return Block(cfg, rngs)

    loops = cfg.virtual_stages
    if loops > 1:  # the same layers (same keys, in order) stacked [V, n/V, ...]
      make_blocks = nnx.vmap(make_blocks, in_axes=0, out_axes=0,
                             transform_metadata={nnx.PARTITION_NAME: 'virtual'})
    self.blocks = make_blocks(rngs.split(cfg.n_layers if loops == 1 else
                                         (loops, cfg.n_layers // loops)))
    self.final_norm = RMSNorm(cfg, rngs)
    if not cfg.tie_embeddings:
      self.unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'),
                           cfg.weight_dtype, cfg.d_model ** -0.5)

  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, microbatches: int = 1):
    """Logits[B, L, V] in fp32. Positions default to 0..L-1; with segment ids (packed rows) a
    token attends only within its own segment, so documents never see each other. Under ring
    attention over a sequence split, rows come in the zigzag order (training.step.context_layout
    lays a batch out so; positions then must be given). With the layers split into pipeline
    stages, the batch flows through them as `microbatches` slices (model/pipeline.py)."""
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    if (stage_axis := sharding.mesh_axis('layers')) is None:
      return self._forward(tokens_BL, positions_BL, segment_ids_BL)
    # Pipeline stages: every stage runs the whole forward on its own share of the layers.
    graphdef, blocks, rest = nnx.split(self, nnx.PathContains('blocks'), ...)

    def forward(blocks, rest, *batch):
      return nnx.merge(graphdef, blocks, rest)._forward(*batch, microbatches, stage_axis)

    staged_dim = int(self.cfg.virtual_stages > 1)  # the 'layers' dimension
    return pipeline.over_stages(forward, stage_axis, staged_dim)(blocks, rest, tokens_BL,
                                                                 positions_BL, segment_ids_BL)

  def _forward(self, tokens_BL, positions_BL, segment_ids_BL, microbatches=1, stage_axis=None):
    cfg = self.cfg
    # The table is gathered (FSDP) once, in the compute dtype: for the lookup, and for a tied
    # head, which keeps it for its backward.
    table_VD = weight(self.embed, cfg)
    table_c_VD = gathered(table_VD, ('vocab', 'embed'), cfg.dtype)
    x_BLD = lookup(table_VD, table_c_VD, tokens_BL)
    x_BLD = constrain(x_BLD, ('batch', 'length', 'embed'))
    x_BLD = self._run_blocks(x_BLD, positions_BL, segment_ids_BL, microbatches, stage_axis)
    return constrain(self._head(x_BLD, table_VD, table_c_VD), ('batch', 'length', 'vocab'))

  def _head(self, x_BLD, table_VD, table_c_VD):
    """Final norm and output projection: logits in fp32. The projection is gathered once, kept
    from the forward to the backward (they follow each other)."""
    cfg = self.cfg
    x_BLD = self.final_norm(x_BLD)
    if cfg.tie_embeddings:
      return matmul('bld,vd->blv', x_BLD, table_VD, jnp.float32, table_c_VD)
    w_DV = weight(self.unembed, cfg)
    w_c_DV = gathered(w_DV, ('embed', 'vocab'), cfg.dtype)
    return matmul('bld,dv->blv', x_BLD, w_DV, jnp.float32, w_c_DV)

  def init_cache(self, batch: int, slots: int) -> dict:
    """An empty KV cache: k and v [layers, B, S, K, H] in the compute dtype."""
    cfg = self.cfg
    shape = (cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.head_dim)
    return {'k': jnp.zeros(shape, cfg.dtype), 'v': jnp.zeros(shape, cfg.dtype)}

  def decode(self, tokens_BT, positions_BT, cache: dict):
    """Logits[B, T, V] of T new tokens per row at `positions_BT`, reading and extending `cache`
    (init_cache) in the slots of those positions; returns (logits, cache). Feeding a prompt and
    then one token at a time gives the logits `__call__` gives the whole sequence."""
    cfg = self.cfg
    table_VD = weight(self.embed, cfg)
    table_c_VD = table_VD.astype(cfg.dtype)
    x_BTD = lookup(table_VD, table_c_VD, tokens_BT)
    graphdef, layers = nnx.split(self.blocks)
    layers = self._in_order(layers)

    def body(x_BTD, layer_and_cache):
      layer, k_BSKH, v_BSKH = layer_and_cache
      x_BTD, k_BSKH, v_BSKH = nnx.merge(graphdef, layer).decode(x_BTD, positions_BT, k_BSKH,
                                                                v_BSKH)
      return x_BTD, (k_BSKH, v_BSKH)

    x_BTD, (k, v) = jax.lax.scan(body, x_BTD, (layers, cache['k'], cache['v']))
    return self._head(x_BTD, table_VD, table_c_VD), {'k': k, 'v': v}

  def _run_blocks(self, x_BLD, positions_BL, segment_ids_BL, microbatches, stage_axis):
    """One `lax.scan` over the stacked layers, so compile time does not grow with depth;
    `scan_layers=False` unrolls the same scan (same parameters, so checkpoints are shared). Split
    into pipeline stages over `stage_axis`, each stage scans its own layers, microbatch by
    microbatch (model/pipeline.py)."""
    graphdef, layers = nnx.split(self.blocks)

    def run_layers(layers, x_BLD, extras, chunk=None):
      """The stacked layers in turn; with `chunk`, row `chunk` of [V, n/(V·P), ...] (a pipeline
      stage's, model/pipeline.py), each layer picked inside its remat region."""
      def body(x_BLD, layer):
        if chunk is not None:  # `layer` is its index
          layer = jax.tree.map(lambda w: pipeline.pick(w, chunk, layer), layers)
        return nnx.merge(graphdef, layer)(x_BLD, *extras), None

      policy = REMAT[self.cfg.remat_policy]
      if policy is None and chunk is not None:
        policy = pipeline.recompute_picks
      if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=not self.cfg.scan_layers)
      xs = layers if chunk is None else jnp.arange(jax.tree.leaves(layers)[0].shape[1])
      return jax.lax.scan(body, x_BLD, xs, unroll=1 if self.cfg.scan_layers else True)[0]

    extras = (positions_BL, segment_ids_BL)
    if stage_axis is None:
      return run_layers(self._in_order(layers), x_BLD, extras)
    x_MbLD = constrain(pipeline.split(x_BLD, microbatches), (None, 'batch', 'length', 'embed'))
    extras_Mb = jax.tree.map(lambda e: pipeline.split(e, microbatches), extras)
    y_MbLD = pipeline.schedule(run_layers, layers, x_MbLD, extras_Mb, stage_axis,
                               self.cfg.virtual_stages)
    return constrain(pipeline.merge(y_MbLD), ('batch', 'length', 'embed'))

  def _in_order(self, layers):
    """Stacked layers as [n, ...] in execution order, from [V, n/V, ...] (neither dimension split:
    a reshape that moves no data)."""
    if self.cfg.virtual_stages == 1:
      return layers
    return jax.tree.map(lambda w: w.reshape(-1, *w.shape[2:]), layers)
