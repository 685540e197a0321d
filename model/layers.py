"""Transformer layers. Each parameter names its logical axes (`out_sharding` metadata); each
activation is pinned to logical axes at layer boundaries with Flax's `with_logical_constraint`.
Which mesh axes those names land on is the business of sharding/rules.py, set around the trace by
the caller; outside a mesh the names change nothing.

Shape suffixes: B batch, L length, D d_model, N query heads, K kv heads, G = N // K,
H head_dim, F d_ff, V vocab. Parameters are written with their logical axes, e.g.
Wq[embed, heads, head_dim].
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import kernels
import sharding
from kernels.matmul import fp8_matmul, matmul
from model import kv_cache
from configs.base import ModelConfig

constrain = nn.with_logical_constraint  # pins an activation to logical axes (no-op off a mesh)


def param(rngs: nnx.Rngs, shape: tuple, names: tuple, dtype, stddev: float | None = None,
          kind: type = nnx.Param):
  """A parameter (of type `kind`) drawn from N(0, stddev²) (ones when stddev is None; zeros when
  it is 0), named by logical axes.

  Eager sharding is off: shardings are applied by the caller's jit (sharding/), so building a
  model never needs a mesh.
  """
  if stddev is None:
    value = jnp.ones(shape, dtype)
  elif stddev == 0:
    value = jnp.zeros(shape, dtype)
  else:
    value = stddev * jax.random.normal(rngs.params(), shape, dtype)
  return kind(value, out_sharding=names, eager_sharding=False)


class LoRA(nnx.Param):
  """A low-rank adapter's parameter: what trains while every other parameter is frozen."""


class Draft(nnx.Param):
  """A draft head's parameter (model/draft.py): added to a base model, as an adapter is."""


# The output projection's name: a remat policy may leave it to recompute from attention's output
# (one matmul a layer) rather than keep it (model/transformer.py: REMAT).
OUT = 'out_projection'
# Queries and keys rotated, as attention takes them: what the dots policies keep of them
ROTATED = 'rotated'
ADDED = (LoRA, Draft)  # parameters a base model's checkpoint does not hold: they start afresh


def added_kind(name: str) -> type | None:
  """LoRA or Draft where a checkpoint's array 'params.blocks.attn.wq_lora.a.value' is of an
  adapter or a draft head (the modules `adapter` and model/draft.py add), by its name alone; None
  for the base's."""
  parts = name.split('.')
  parts = parts[1:] if parts[0] in ('params', 'opt_state') else parts
  if parts[0] == 'draft':
    return Draft
  return LoRA if any(part.endswith('_lora') for part in parts) else None


def is_added(name: str) -> bool:
  """Whether a checkpoint's array is an adapter's or a draft head's: what a run started from
  another's base leaves out of that run's checkpoint."""
  return added_kind(name) is not None


class Adapter(nnx.Module):
  """LoRA on a projection W[in…, out…]: A[in…, lora] drawn as PEFT draws it (uniform within
  ±1/√fan_in), B[lora, out…] zero, so the adapted model starts as the base; the projection gains
  (alpha/r) · (x A) B. A and B take W's logical names for its dimensions, so they shard with it,
  and 'lora' (replicated) for the rank."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, in_shape: tuple, in_names: tuple,
               out_shape: tuple, out_names: tuple):
    r, dt, fan_in = cfg.lora_rank, cfg.param_dtype, int(np.prod(in_shape))
    bound = fan_in ** -0.5
    self.a = LoRA(jax.random.uniform(rngs.params(), (*in_shape, r), dt, -bound, bound),
                  out_sharding=(*in_names, 'lora'), eager_sharding=False)
    self.b = LoRA(jnp.zeros((r, *out_shape), dt), out_sharding=('lora', *out_names),
                  eager_sharding=False)
    self.scale = cfg.lora_scale

  def __call__(self, spec: str, x):
    """(alpha/r) · (x A) B for the projection `spec` ('bld,dnh->blnh'), in x's dtype."""
    inputs, out = spec.split('->')
    x_letters, w_letters = inputs.split(',')
    reduced = ''.join(c for c in w_letters if c in x_letters)
    kept = ''.join(c for c in x_letters if c not in reduced)
    xa = jnp.einsum(f'{x_letters},{reduced}r->{kept}r', x, self.a[...].astype(x.dtype))
    xab = jnp.einsum(f'{kept}r,r{w_letters[len(reduced):]}->{out}', xa,
                     self.b[...].astype(x.dtype))
    return (self.scale * xab).astype(x.dtype)


def adapter(cfg: ModelConfig, rngs: nnx.Rngs, target: str, in_shape, in_names, out_shape,
            out_names) -> Adapter | None:
  """The adapter of projection `target` (configs/base.py: LORA_TARGETS), if cfg adapts it."""
  if not cfg.lora_rank or target not in cfg.lora_target_names:
    return None
  return Adapter(cfg, rngs, in_shape, in_names, out_shape, out_names)


def split_adapters(params, kinds=(LoRA,)):
  """(the parameters of `kinds`, the rest): under LoRA the adapters and the base."""
  return nnx.split_state(params, kinds, ...)


ADAPTED = '_lora'  # an adapter's attribute: its weight's name and this


def adapters_in(params: dict) -> list[tuple[tuple, dict]]:
  """(path of the adapted weight, the adapter's {'a', 'b'}) for each adapter in nested dicts of
  arrays (nnx.to_pure_dict's)."""
  def walk(tree, path):
    for key, value in tree.items():
      if key.endswith(ADAPTED):
        yield (*path, key[:-len(ADAPTED)]), value
      elif isinstance(value, dict):
        yield from walk(value, (*path, key))
  return list(walk(params, ()))


def adapters_merged(params: dict, scale: float, xp=jnp) -> dict:
  """Nested dicts of arrays without their adapters, each adapted weight W + scale · A B (summed
  in fp32, then in W's dtype): the model the adapters make, as a plain base (PEFT's
  merge_and_unload). `xp`: numpy on the host, jax.numpy in a program (on the shards)."""
  def copy(tree):
    return {k: copy(v) if isinstance(v, dict) else v for k, v in tree.items()
            if not k.endswith(ADAPTED)}

  out = copy(params)
  for path, adapter in adapters_in(params):
    parent = out
    for key in path[:-1]:
      parent = parent[key]
    w, a, b = parent[path[-1]], adapter['a'], adapter['b']
    lead = a.ndim + b.ndim - 2 - w.ndim  # A[lead…, in…, r] @ B[lead…, r, out…]
    a = xp.asarray(a, xp.float32).reshape(*a.shape[:lead], -1, a.shape[-1])
    b = xp.asarray(b, xp.float32).reshape(*b.shape[:lead + 1], -1)
    delta = xp.matmul(a, b).reshape(w.shape)
    parent[path[-1]] = (xp.asarray(w, xp.float32) + scale * delta).astype(w.dtype)
  return out


def gathered(w, names: tuple, dtype):
  """w cast to `dtype` where it lies (its parameter sharding), then laid out as compute names it:
  an FSDP gather moves the compute dtype, never the fp32 master copy."""
  return constrain(constrain(w.astype(dtype), names, rules=sharding.PARAM_RULES), names)


def weight(p: nnx.Param, cfg: ModelConfig):
  """A parameter as a matmul takes it: in the gradient reduction dtype (see matmul)."""
  return p[...].astype(cfg.reduce_dtype)


def project(spec: str, x, p: nnx.Param, cfg: ModelConfig, lora: Adapter | None = None,
            name: str = 'projection'):
  """matmul of x by a layer's weight p (plus its adapter's output, under LoRA). Under a remat
  policy the backward recomputes the forward, the weight's FSDP gather included, so the backward
  uses that gather rather than make its own; without one, the backward gathers again rather than
  hold every layer's whole weights from forward to backward (ZeRO-3). With matmul_precision 'fp8'
  the operands are scaled fp8 (kernels/matmul.py: fp8_matmul)."""
  w = weight(p, cfg)
  multiply = fp8_matmul if cfg.matmul_precision == 'fp8' else matmul
  out = multiply(spec, x, w, x.dtype, None if cfg.remat_policy == 'none' else w.astype(x.dtype))
  if lora is not None:
    out = out + lora(spec, x)
  # Remat policies cannot see the dots inside a custom_vjp: the name lets them save its output
  # (model/transformer.py: REMAT; attention's output projection is 'out_projection').
  return checkpoint_name(out, name)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last dimension, computed in fp32; with cfg.norm_plus_one
  (Gemma's) * (1 + scale), the scale starting at 0. scale[D] (or [size]) is logical 'norm'
  (replicated, no decay)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, size: int | None = None):
    self.eps, self.plus_one = cfg.norm_eps, cfg.norm_plus_one
    self.scale = param(rngs, (size or cfg.d_model,), ('norm',), cfg.weight_dtype,
                       0 if cfg.norm_plus_one else None)

  def __call__(self, x_BLD):
    return rms_norm(x_BLD, self.scale[...], self.eps, self.plus_one)


def rms_norm(x, scale, eps: float, plus_one: bool = False):
  """x / rms(x) * scale (or * (1 + scale)) over the last dimension, in fp32, returned in x's
  dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale32 = scale.astype(jnp.float32)
  return (x32 * (1.0 + scale32 if plus_one else scale32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
  """RoPE's inverse frequencies, one per pair of head dimensions: theta^(-2i/H); with rope_type
  'linear' divided by rope_factor, and with 'llama3' Llama 3.1's rescaling (as transformers
  computes it): wavelengths longer than original_length/low_freq_factor are stretched by
  `factor`, those shorter than original_length/high_freq_factor kept, those between blended
  linearly in original_length/wavelength. A `local` layer's (sliding_window) with
  rope_local_theta: that base's, unscaled."""
  H = cfg.head_dim
  theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
  inv_freq_h = (theta ** (-np.arange(0, H // 2, dtype=np.float32) / (H // 2))).astype(np.float32)
  if cfg.rope_type == 'default' or (local and cfg.rope_local_theta):
    return inv_freq_h
  if cfg.rope_type == 'linear':
    return (inv_freq_h / np.float32(cfg.rope_factor)).astype(np.float32)
  wavelength_h = 2 * np.pi / inv_freq_h
  low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  original = cfg.rope_original_length
  blend_h = (original / wavelength_h - low) / (high - low)  # 0 at the low edge, 1 at the high
  blended_h = (1 - blend_h) * inv_freq_h / cfg.rope_factor + blend_h * inv_freq_h
  return np.where(wavelength_h > original / low, inv_freq_h / cfg.rope_factor,
                  np.where(wavelength_h < original / high, inv_freq_h, blended_h)
                  ).astype(np.float32)


def rotary(x_BLNH, positions_BL, inv_freq_h: np.ndarray):
  """Rotary position embedding (Llama's rotate-half layout), in fp32, at the frequencies of
  `rope_frequencies`."""
  angle_BLh = positions_BL[..., None].astype(jnp.float32) * inv_freq_h
  sin_BL11h, cos_BL11h = (f(angle_BLh)[:, :, None, None] for f in (jnp.sin, jnp.cos))
  # The halves (x1, x2) as one [2, h] axis: x·cos + (−x2, x1)·sin in one element-wise pass, the
  # same arithmetic as splitting and concatenating them, which XLA runs as two passes.
  B, L, N, H = x_BLNH.shape
  x_BLN2h = x_BLNH.astype(jnp.float32).reshape(B, L, N, 2, H // 2)
  sign_21 = np.array([[-1.0], [1.0]], np.float32)
  out = x_BLN2h * cos_BL11h + jnp.flip(x_BLN2h, axis=-2) * sign_21 * sin_BL11h
  return out.reshape(B, L, N, H).astype(x_BLNH.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention: Wq[embed, heads, head_dim], Wk and Wv[embed, kv_heads,
  head_dim], Wo[heads, head_dim, embed]. Splitting heads (and kv_heads) makes Wq/Wk/Wv
  column-parallel and Wo row-parallel."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    D, N, K, H, dt = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.weight_dtype
    self.wq = param(rngs, (D, N, H), ('embed', 'heads', 'head_dim'), dt, D ** -0.5)
    self.wk = param(rngs, (D, K, H), ('embed', 'kv_heads', 'head_dim'), dt, D ** -0.5)
    self.wv = param(rngs, (D, K, H), ('embed', 'kv_heads', 'head_dim'), dt, D ** -0.5)
    self.wo = param(rngs, (N, H, D), ('heads', 'head_dim', 'embed'), dt, (N * H) ** -0.5)
    D_, NH, KH = ((D,), ('embed',)), ((N, H), ('heads', 'head_dim')), ((K, H), ('kv_heads',
                                                                            'head_dim'))
    self.wq_lora = adapter(cfg, rngs, 'q', *D_, *NH)
    self.wk_lora = adapter(cfg, rngs, 'k', *D_, *KH)
    self.wv_lora = adapter(cfg, rngs, 'v', *D_, *KH)
    self.wo_lora = adapter(cfg, rngs, 'o', *NH, *D_)
    if cfg.qk_norm:  # one scale[H] each, shared by the heads
      self.q_norm, self.k_norm = RMSNorm(cfg, rngs, H), RMSNorm(cfg, rngs, H)

  def _project(self, x_BLD, positions_BL, layer: dict):
    """q, k, v with rotary embeddings applied to q and k (after their norms, with qk_norm)."""
    cfg = self.cfg
    k_BLKH = project('bld,dkh->blkh', x_BLD, self.wk, cfg, self.wk_lora)
    v_BLKH = project('bld,dkh->blkh', x_BLD, self.wv, cfg, self.wv_lora)
    return (self._queries(x_BLD, positions_BL, layer), self._keys(k_BLKH, positions_BL, layer),
            v_BLKH)

  def _queries(self, x_BLD, positions_BL, layer: dict):
    """Projected queries as attention takes them: normed (with qk_norm), rotated, and with
    query_scale rescaled so that attention's 1/√head_dim makes the scale asked for."""
    cfg = self.cfg
    q_BLNH = project('bld,dnh->blnh', x_BLD, self.wq, cfg, self.wq_lora)
    if cfg.qk_norm:
      q_BLNH = self.q_norm(q_BLNH)
    q_BLNH = rotary(q_BLNH, positions_BL, layer['rope'])
    if cfg.query_scale and cfg.query_scale != cfg.head_dim:
      q_BLNH = q_BLNH * jnp.asarray((cfg.head_dim / cfg.query_scale) ** 0.5, q_BLNH.dtype)
    return q_BLNH

  def _keys(self, k_BLKH, positions_BL, layer: dict):
    """Projected keys as attention takes them: normed (with qk_norm), then rotated."""
    if self.cfg.qk_norm:
      k_BLKH = self.k_norm(k_BLKH)
    return rotary(k_BLKH, positions_BL, layer['rope'])

  def kv_weights(self):
    """(Wk, Wv) [embed, kv_heads, head_dim] in fp32 with their adapters merged: what an X cache
    (model/kv_cache.py) recomputes keys and values with."""
    def merged(p, lora):
      w = p[...].astype(jnp.float32)
      if lora is None:
        return w
      return w + lora.scale * jnp.einsum('dr,rkh->dkh', lora.a[...].astype(jnp.float32),
                                         lora.b[...].astype(jnp.float32))
    return merged(self.wk, self.wk_lora), merged(self.wv, self.wv_lora)

  def decode(self, x_BTD, positions_BT, cache: dict, index, weights: dict, kind: dict):
    """T new tokens per row (consecutive positions; −1: a pad, neither kept nor seen) against
    the cache (model/kv_cache.py), this layer the `index`-th of its kind: a global layer's
    entries hold position s in slot s, a local layer's (`kind`'s window an int) a ring of its
    newest positions. Writes what the cache keeps of the new tokens and attends to the keys up
    to each one's position, within the window. An X cache's keys and values are recomputed from
    it with `weights` (kv_cache.x_weights). Returns (out, the whole cache)."""
    if kind['window'] is not None:
      return self._decode_local(x_BTD, positions_BT, cache, index, weights, kind)
    cfg = self.cfg
    rows_B1 = jnp.arange(x_BTD.shape[0])[:, None]
    name = 'x' if 'x' in cache else 'k'
    slots_BT = kv_cache.slots_of(positions_BT, kv_cache.leaf_shape(cache[name])[2], ring=False)
    if name == 'x':
      q_BTNH = self._queries(x_BTD, positions_BT, kind)
      new = kv_cache.latent(x_BTD, weights, kv_cache.x_group(cfg))
      cache = dict(cache, x=kv_cache.store(cache['x'], index, rows_B1, slots_BT, new))
      k_BSKH, v_BSKH = kv_cache.recompute(kv_cache.read(cache['x'], index, cfg.dtype), weights)
      B, S = k_BSKH.shape[:2]
      k_BSKH = self._keys(k_BSKH, jnp.broadcast_to(jnp.arange(S), (B, S)), kind)
    else:
      q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions_BT, kind)
      cache = dict(cache, **{name: kv_cache.store(cache[name], index, rows_B1, slots_BT, new)
                             for name, new in (('k', k_BTKH), ('v', v_BTKH))})
      k_BSKH, v_BSKH = (kv_cache.read(cache[name], index, cfg.dtype) for name in ('k', 'v'))
    out_BTNH = kernels.cached_attention(q_BTNH, k_BSKH, v_BSKH, positions_BT)
    return project('btnh,nhd->btd', out_BTNH, self.wo, cfg, self.wo_lora, OUT), cache

  def _decode_local(self, x_BTD, positions_BT, cache: dict, index, weights: dict, kind: dict):
    """decode for a local layer: the new tokens attend to the ring's keys from before them and
    to their own (so a call may bring more tokens than the ring holds, a prompt), then the ring
    keeps the newest of them."""
    cfg = self.cfg
    rows_B1 = jnp.arange(x_BTD.shape[0])[:, None]
    held_BR = cache['positions_local'][index]
    R = held_BR.shape[1]
    first_B1 = jnp.where(positions_BT >= 0, positions_BT,
                         jnp.iinfo(jnp.int32).max).min(1, keepdims=True)
    # Keys the ring holds from before this call's tokens; a refused guess's (at or past them) not
    held_BR = jnp.where(held_BR < first_B1, held_BR, -1)
    if 'x_local' in cache:
      q_BTNH = self._queries(x_BTD, positions_BT, kind)
      new = kv_cache.latent(x_BTD, weights, kv_cache.x_group(cfg))
      old_k, old_v = kv_cache.recompute(kv_cache.read(cache['x_local'], index, cfg.dtype), weights)
      old_k = self._keys(old_k, jnp.maximum(held_BR, 0), kind)
      k_BTKH, v_BTKH = kv_cache.recompute(new.astype(cfg.dtype), weights)
      k_BTKH = self._keys(k_BTKH, positions_BT, kind)
      writes = {'x_local': new}
    else:
      q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions_BT, kind)
      old_k, old_v = (kv_cache.read(cache[name], index, cfg.dtype)
                      for name in ('k_local', 'v_local'))
      writes = {'k_local': k_BTKH, 'v_local': v_BTKH}
    out_BTNH = kernels.positioned_attention(
        q_BTNH, jnp.concatenate([old_k, k_BTKH.astype(old_k.dtype)], axis=1),
        jnp.concatenate([old_v, v_BTKH.astype(old_v.dtype)], axis=1), positions_BT,
        jnp.concatenate([held_BR, positions_BT], axis=1), kind['window'])
    slots_BT = kv_cache.slots_of(positions_BT, R, ring=True)
    cache = dict(cache, **{name: kv_cache.store(cache[name], index, rows_B1, slots_BT, new)
                           for name, new in writes.items()})
    cache['positions_local'] = cache['positions_local'].at[index, rows_B1, slots_BT].set(
        positions_BT, mode='drop')
    return project('btnh,nhd->btd', out_BTNH, self.wo, cfg, self.wo_lora, OUT), cache

  def _attend(self, q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, window):
    """Attention by cfg.attention; `window`: None (global), the window (a local layer's, an int)
    or, with local and global layers scanned alike, an int32 scalar known at run time (0:
    global), which the XLA path and our kernel take as an input. With cfg.qk_clip, (out, each
    query's log-sum-exp [B, N, L])."""
    cfg = self.cfg
    lse = cfg.qk_clip > 0
    ours = dict(block_q=cfg.attention_block_q, block_k=cfg.attention_block_k,
                hopper=cfg.attention == 'hopper')  # in Triton, or Mosaic GPU for Hopper
    if lse:
      ours['with_lse'] = True
    run = sharding.per_shard
    if cfg.attention == 'xla':
      return kernels.attention(q_BLNH, k_BLKH, v_BLKH, causal=True, segment_ids_BL=segment_ids_BL,
                               window=window, with_lse=lse)
    if cfg.attention == 'cudnn':  # XLA partitions it, where it can
      attend = functools.partial(kernels.attention, causal=True, implementation='cudnn',
                                 cudnn_segments=cfg.cudnn_segments)
      # Packed rows choose between cuDNN's packed layout and its dense mask (a conditional), which
      # XLA's partitioner would run on every device's whole batch in the backward: per shard, each
      # device chooses for its own rows.
      packed = segment_ids_BL is not None and cfg.cudnn_segments
      run = sharding.per_shard if packed else sharding.partitioned
    elif (axis := sharding.mesh_axis('length')) is None:
      attend = functools.partial(kernels.flash_attention, causal=True, **ours)
    elif cfg.context_parallel == 'ring':
      attend = functools.partial(kernels.ring_attention, causal=True, axis_name=axis,
                                 reduce_dtype=cfg.reduce_dtype.name, **ours)
    else:
      attend = functools.partial(kernels.gathered_attention, causal=True, axis_name=axis, **ours)
    if cfg.attention in kernels.OURS and window is not None and not isinstance(window, int):
      local = cfg.local_layers  # what the windows leave of the work, for the time model
      attend = functools.partial(attend, window_mix=(cfg.sliding_window, sum(local) / len(local)))
    # XLA cannot partition a Pallas call: each device runs it on its rows, heads and, under a
    # length split, its share of the length, against the others' keys (context parallelism).
    q_names = ('batch', 'length', 'heads', 'head_dim')
    kv_names = ('batch', 'length', 'kv_heads', 'head_dim')
    args, names, keywords = [q_BLNH, k_BLKH, v_BLKH], [q_names, kv_names, kv_names], []
    if segment_ids_BL is not None:
      args, names = args + [segment_ids_BL], names + [('batch', 'length')]
      keywords = ['segment_ids_BL']
    if isinstance(window, int):  # a constant of the program
      attend = functools.partial(attend, window=window)
    elif window is not None:  # a scalar input, every device the same
      args, names, keywords = args + [window], names + [()], keywords + ['window']
    out_names = [q_names, ('batch', 'heads', 'length')] if lse else q_names
    return run(lambda q, k, v, *rest: attend(q, k, v, **dict(zip(keywords, rest))),
               tuple(names), out_names)(*args)

  def __call__(self, x_BLD, positions_BL, segment_ids_BL, layer: dict):
    """`layer`: this layer's kind (Block.kind): its RoPE frequencies and window (None: global)."""
    q_BLNH, k_BLKH, v_BLKH = self._project(x_BLD, positions_BL, layer)
    # With qk_norm, whose backward reads the projections' outputs, those alone are kept; under
    # LoRA the time model predicts the rotated ones slower (docs/notes/retunings.md)
    if not (self.cfg.qk_norm or self.cfg.lora_rank):
      q_BLNH, k_BLKH = checkpoint_name(q_BLNH, ROTATED), checkpoint_name(k_BLKH, ROTATED)
    q_BLNH = checkpoint_name(q_BLNH, 'query_proj')
    k_BLKH = checkpoint_name(k_BLKH, 'key_proj')
    v_BLKH = checkpoint_name(v_BLKH, 'value_proj')
    q_BLNH = constrain(q_BLNH, ('batch', 'length', 'heads', 'head_dim'))
    # Under a length split, XLA's attention all-gathers keys and values (logical 'kv_length');
    # our kernel takes each device's share and moves them itself (context parallelism).
    # Pinned to the device's own rows first, so that the gather moves them in the compute dtype,
    # after the rotation (XLA would otherwise gather its fp32 input, or x for Wv).
    kv_names = ('batch', 'length', 'kv_heads', 'head_dim')
    k_BLKH, v_BLKH = constrain(k_BLKH, kv_names), constrain(v_BLKH, kv_names)
    if self.cfg.attention not in kernels.OURS:
      kv_names = ('batch', 'kv_length', 'kv_heads', 'head_dim')
      k_BLKH, v_BLKH = constrain(k_BLKH, kv_names), constrain(v_BLKH, kv_names)
    out_BLNH = self._attend(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, layer['window'])
    out_BLNH, lse_BNL = out_BLNH if self.cfg.qk_clip else (out_BLNH, None)
    out_BLNH = checkpoint_name(constrain(out_BLNH, ('batch', 'length', 'heads', 'head_dim')),
                               'attention_out')
    out_BLD = project('blnh,nhd->bld', out_BLNH, self.wo, self.cfg, self.wo_lora, OUT)
    if lse_BNL is None:
      return out_BLD
    # QK-clip's measure of each head: its largest log-sum-exp over the batch's queries, an upper
    # bound of its largest logit (within log(keys seen): tight when one key dominates, where the
    # clip matters), which our kernel and the XLA path give for free
    return out_BLD, lse_BNL.max(axis=(0, 2))


class MLP(nnx.Module):
  """SwiGLU: (silu(x Wg) * x Wu) Wd with Wg, Wu[embed, mlp] and Wd[mlp, embed]; GeGLU (gelu with
  tanh's approximation for silu) with cfg.mlp_activation 'gelu_tanh'."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None):
    self.cfg = cfg
    D, F, dt = cfg.d_model, d_ff or cfg.d_ff, cfg.weight_dtype
    self.w_gate = param(rngs, (D, F), ('embed', 'mlp'), dt, D ** -0.5)
    self.w_up = param(rngs, (D, F), ('embed', 'mlp'), dt, D ** -0.5)
    self.w_down = param(rngs, (F, D), ('mlp', 'embed'), dt, F ** -0.5)
    D_, F_ = ((D,), ('embed',)), ((F,), ('mlp',))
    self.w_gate_lora = adapter(cfg, rngs, 'gate', *D_, *F_)
    self.w_up_lora = adapter(cfg, rngs, 'up', *D_, *F_)
    self.w_down_lora = adapter(cfg, rngs, 'down', *F_, *D_)

  def __call__(self, x_BLD):
    cfg = self.cfg
    gate_BLF = project('bld,df->blf', x_BLD, self.w_gate, cfg, self.w_gate_lora)
    up_BLF = project('bld,df->blf', x_BLD, self.w_up, cfg, self.w_up_lora)
    act = jax.nn.silu if cfg.mlp_activation == 'silu' else functools.partial(jax.nn.gelu,
                                                                            approximate=True)
    h_BLF = constrain(act(gate_BLF) * up_BLF, ('batch', 'length', 'mlp'))
    h_BLF = checkpoint_name(h_BLF, 'mlp_hidden')
    return project('blf,fd->bld', h_BLF, self.w_down, cfg, self.w_down_lora)


def _leaf(entry):
  """A cache entry's array of values (a quantized one's values, beside its scales)."""
  return entry['q'] if isinstance(entry, dict) else entry
