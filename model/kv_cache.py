"""What decoding keeps of each past token, per layer (`Transformer.init_cache`, `decode`):

  full     K and V [B, S, K, H] in the compute dtype (bf16 by default)
  int8     K and V as int8, a fp16 scale per token and head: about half the bytes of full
  int4     K and V as int4 (two a byte), a fp16 scale per token and head: about a quarter
  x        XQuant's X cache in the compute dtype: the layer's normed input, K and V recomputed
           from it at every step
  xquant   the X cache as int8, a fp16 scale per token and group of head_dim channels
  xquant4  the X cache as int4, scaled the same way

XQuant (Tomar et al., 2025) caches X rather than K and V. For a model whose K and V together are
narrower than X (GQA: 2·K·H < D), X alone would be the larger cache, so it is projected first, as
XQuant does for GQA models: onto U [D, R], the R = 2·K·H left singular vectors of the layer's
[Wk | Wv]. Since Wk and Wv lie in U's span, K = (X U)(Uᵀ Wk) exactly: the latent X U loses
nothing, and the step recomputes K and V from it with the fused Uᵀ Wk and Uᵀ Wv [R, K, H]. Where
2·K·H ≥ D (MHA, and the default model, where 2·K·H = D) X is cached itself, its own width D. An X
cache therefore never stores more than K and V do; it differs from them in what is quantized: X
(or its latent) before RoPE, rather than the rotated keys, and one tensor rather than two.

A local layer (a sliding window of W keys: config.model.sliding_window) keeps only the newest
R = min(S, W + ahead) positions, in a ring: position p in slot p mod R, its position beside it
('positions_local', −1 where empty), so its cache is bounded by its window, not by the length
decoded. `ahead` is the most positions a call writes that a later call may refuse (speculative
decoding's guesses): their slots' old keys must stay until the next call. Global layers keep
every position, slot p for position p. The cache's entries: 'k', 'v' (or 'x') [global layers,
B, S, ...], 'k_local', 'v_local' (or 'x_local') [local layers, B, R, ...] and
'positions_local' [local layers, B, R]; a layer's index is its place among the layers of its
kind.

Every stored entry is [B, S, groups, group size] (K, V: a group a head); a quantized one is {'q':
the values, 'scale': fp16 [B, S, groups]}, symmetric per (token, group): q = round(x / scale),
scale = max|x| / qmax (127 for int8, 7 for int4). int4 values are stored in pairs, a uint8 each
([B, S, groups, size / 2]; the low nibble the even channel).
"""

import jax.numpy as jnp
import numpy as np

BITS = {'full': None, 'int8': 8, 'int4': 4, 'x': None, 'xquant': 8, 'xquant4': 4}
KINDS = tuple(BITS)
QUANTIZED = tuple(kind for kind, bits in BITS.items() if bits)
SCALE_DTYPE = jnp.float16


def quantize(x_BSGH, bits: int = 8):
  """(values, fp16 scales [B, S, G]): symmetric, one scale per token and group; int8 values, or
  int4 packed two a uint8."""
  qmax = 2 ** (bits - 1) - 1
  x = x_BSGH.astype(jnp.float32)
  scale = (jnp.max(jnp.abs(x), axis=-1) / qmax).astype(SCALE_DTYPE)
  safe = jnp.where(scale == 0, 1, scale).astype(jnp.float32)[..., None]
  q = jnp.clip(jnp.round(x / safe), -qmax, qmax).astype(jnp.int8)
  if bits == 4:
    nibbles = (q & 0xF).astype(jnp.uint8)
    q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
  return q, scale


def dequantize(q_BSGH, scale_BSG, dtype):
  """x from quantize's values (int8, or uint8 pairs of int4) and scales."""
  if q_BSGH.dtype == jnp.uint8:  # int4 pairs: sign-extend each nibble, then interleave
    low, high = (q_BSGH & 0xF).astype(jnp.int8), (q_BSGH >> 4).astype(jnp.int8)
    pair = jnp.stack([low, high], axis=-1)
    q_BSGH = jnp.where(pair >= 8, pair - 16, pair).reshape(*q_BSGH.shape[:-1], -1)
  return (q_BSGH.astype(jnp.float32) * scale_BSG.astype(jnp.float32)[..., None]).astype(dtype)


def is_x_cache(kind: str) -> bool:
  return kind.startswith('x')


def x_width(cfg) -> int:
  """What an X cache keeps per token: D, or the latent's R = 2·K·H when that is narrower."""
  return min(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim)


def x_group(cfg) -> int:
  """The X cache's channels per scale: head_dim where it divides the width, else all of them."""
  R = x_width(cfg)
  return cfg.head_dim if R % cfg.head_dim == 0 else R


def entry_shapes(cfg, kind: str, batch: int, slots: int) -> dict:
  """The stored entries of one layer: name → [B, S, groups, group size]."""
  if is_x_cache(kind):
    g = x_group(cfg)
    return {'x': (batch, slots, x_width(cfg) // g, g)}
  H = cfg.head_dim
  return {'k': (batch, slots, cfg.n_kv_heads, H), 'v': (batch, slots, cfg.n_kv_heads, H)}


def empty(cfg, kind: str, layers: int, batch: int, slots: int) -> dict:
  """Zeroed entries [layers, B, S, groups, H] (quantized: values and scales)."""
  cache = {}
  for name, shape in entry_shapes(cfg, kind, batch, slots).items():
    if BITS[kind] == 8:
      cache[name] = {'q': jnp.zeros((layers, *shape), jnp.int8),
                     'scale': jnp.zeros((layers, *shape[:-1]), SCALE_DTYPE)}
    elif BITS[kind] == 4:
      if shape[-1] % 2:
        raise ValueError(f'cache kind {kind!r} packs channels in pairs; this model has groups of '
                         f'{shape[-1]}: use {dict(int4="int8", xquant4="xquant")[kind]}')
      cache[name] = {'q': jnp.zeros((layers, *shape[:-1], shape[-1] // 2), jnp.uint8),
                     'scale': jnp.zeros((layers, *shape[:-1]), SCALE_DTYPE)}
    else:
      cache[name] = jnp.zeros((layers, *shape), cfg.dtype)
  return cache


def ring_slots(cfg, slots: int, ahead: int = 0) -> int:
  """The slots a local layer's ring keeps for a cache of `slots` positions (module docstring)."""
  return min(slots, cfg.sliding_window + ahead)


def layers_of_each_kind(cfg) -> tuple[int, int]:
  """(global layers, local layers)."""
  local = sum(cfg.local_layers)
  return cfg.n_layers - local, local


def stored_bytes(cfg, kind: str, batch: int, slots: int, ahead: int = 0) -> int:
  """Bytes a cache of `slots` positions for `batch` rows stores (its entries; not an X cache's
  constants): every position for global layers, a ring and its positions for local ones."""
  n_global, n_local = layers_of_each_kind(cfg)
  ring = ring_slots(cfg, slots, ahead) if n_local else 0
  per_token = bytes_per_token(cfg, kind)
  return batch * (n_global * slots * per_token + n_local * ring * (per_token + 4))


def slots_of(positions_BT, size: int, ring: bool):
  """Where tokens at `positions_BT` are written in a layer's cache of `size` slots: slot p (a
  global layer's), or p mod size (a ring's); `size`, out of bounds, where nothing is written:
  pads (position < 0) and, in a ring, a token a later one of its row takes the slot of (the
  positions of a call are consecutive, pads after them)."""
  keep_BT = positions_BT >= 0
  if ring:
    keep_BT &= positions_BT > positions_BT.max(axis=1, keepdims=True) - size
    return jnp.where(keep_BT, positions_BT % size, size)
  return jnp.where(keep_BT, positions_BT, size)


def bytes_per_token(cfg, kind: str) -> int:
  """Bytes one token takes in one layer's cache."""
  total = 0
  for shape in entry_shapes(cfg, kind, 1, 1).values():
    values = int(np.prod(shape))
    if BITS[kind]:
      total += values * BITS[kind] // 8 + int(np.prod(shape[:-1])) * jnp.dtype(SCALE_DTYPE).itemsize
    else:
      total += values * jnp.dtype(cfg.dtype).itemsize
  return total


def fixed_bytes(cfg, kind: str) -> int:
  """An X cache's per-model constants: each layer's basis U [D, R] (when projected) and the
  fused Uᵀ Wk, Uᵀ Wv [R, K, H], in the compute dtype."""
  if not is_x_cache(kind):
    return 0
  R, D = x_width(cfg), cfg.d_model
  per_layer = (D * R if R < D else 0) + 2 * R * cfg.n_kv_heads * cfg.head_dim
  return cfg.n_layers * per_layer * jnp.dtype(cfg.dtype).itemsize


def x_weights(wk_DKH, wv_DKH, dtype) -> dict:
  """A layer's X-cache constants from its (effective) Wk and Wv: {'wk', 'wv'} [R, K, H], and
  'basis' U [D, R] when 2·K·H < D (else X is kept as it is and R = D)."""
  D, K, H = wk_DKH.shape
  if 2 * K * H >= D:
    return {'wk': wk_DKH.astype(dtype), 'wv': wv_DKH.astype(dtype)}
  w_DC = jnp.concatenate([wk_DKH.reshape(D, K * H), wv_DKH.reshape(D, K * H)], axis=1)
  u_DR = jnp.linalg.svd(w_DC.astype(jnp.float32), full_matrices=False)[0]
  fuse = lambda w_DKH: jnp.einsum('dr,dkh->rkh', u_DR, w_DKH.astype(jnp.float32)).astype(dtype)
  return {'basis': u_DR.astype(dtype), 'wk': fuse(wk_DKH), 'wv': fuse(wv_DKH)}


def latent(x_BTD, weights: dict, group: int):
  """What an X cache stores of the new tokens: X, or X U, as [B, T, R/group, group]."""
  if 'basis' in weights:
    x_BTD = jnp.einsum('btd,dr->btr', x_BTD, weights['basis'].astype(x_BTD.dtype))
  B, T, R = x_BTD.shape
  return x_BTD.reshape(B, T, R // group, group)


def recompute(z_BSGg, weights: dict):
  """K and V [B, S, K, H] of every slot from the X cache (before qk_norm and RoPE)."""
  B, S = z_BSGg.shape[:2]
  z_BSR = z_BSGg.reshape(B, S, -1)
  return tuple(jnp.einsum('bsr,rkh->bskh', z_BSR, weights[w].astype(z_BSR.dtype))
               for w in ('wk', 'wv'))


def store(entry, layer, rows_B1, slots_BT, new_BTGH):
  """`entry` [layers, B, S, ...] with the new tokens written into layer `layer`'s `slots_BT`
  (slots_of; out of bounds: not written), in place where the entry is a loop's carry."""
  if isinstance(entry, dict):
    q, scale = quantize(new_BTGH, 4 if entry['q'].dtype == jnp.uint8 else 8)
    return {'q': entry['q'].at[layer, rows_B1, slots_BT].set(q, mode='drop'),
            'scale': entry['scale'].at[layer, rows_B1, slots_BT].set(scale, mode='drop')}
  return entry.at[layer, rows_B1, slots_BT].set(new_BTGH.astype(entry.dtype), mode='drop')


def read(entry, layer, dtype):
  """Layer `layer` of the entry, [B, S, G, H], as the attention reads it, in `dtype`."""
  if isinstance(entry, dict):
    return dequantize(entry['q'][layer], entry['scale'][layer], dtype)
  return entry[layer].astype(dtype)


def leaf_shape(entry) -> tuple:
  """The shape of an entry's values (a quantized one's, beside its scales)."""
  return (entry['q'] if isinstance(entry, dict) else entry).shape
