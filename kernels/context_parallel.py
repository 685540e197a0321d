"""Context parallelism: attention over a sequence split across the devices of one mesh axis.

Both functions run inside `jax.shard_map` (sharding.per_shard), on each device's share of the
length, and take the axis's name.

`ring_attention`: each device keeps its queries; the keys and values (with their segment ids)
travel around the ring of devices with `ppermute`, each hop sent before the attention of the
chunk in hand so the two overlap. Every visit runs our flash kernel (kernels/flash_attention.py)
and gives a part (o, lse); parts merge exactly in fp32, o = Σ exp(lse_i − lse) o_i with lse the
log-sum-exp of the lse_i. The backward (custom VJP) sends the keys and values round again, now
with their gradients: dK and dV (in `reduce_dtype`) accumulate as they travel and reach their
owner on the last hop, so each device sends n−1 chunks of K, V forward, n−1 of K, V and n−1 of
dK, dV backward, and no device ever holds the whole length.

Causal load balance ("zigzag"): split the length into 2n chunks; device r holds chunks r and
2n−1−r (`zigzag_order` lays a batch out so; the step applies it once to every [B, L] array of the
batch, so the loss is unchanged). Device r, visited by device s's keys:
  s = r: its own two chunks, causal (chunk 2n−1−r sees chunk r whole);
  s < r: both query chunks see key chunk s whole, and none sees 2n−1−s;
  s > r: query chunk 2n−1−r sees both key chunks whole, and chunk r sees neither.
So every visit is two chunk-pairs of work with no mask but the documents', on every device; the
fully masked pairs are never computed.

A sliding window (a local layer's; an int, or an int32 scalar known at run time, 0: global) makes
each visit its four chunk-pairs, query chunk i against key chunk j causal from the offset (i − j)
chunks, the window counted in the row's positions: the kernel visits only the key blocks the
window reaches, so a pair wholly outside it (or after its queries) costs a launch and no blocks.
A window reaching h chunks back needs only the keys of the h devices each side (zigzag folds
the second chunks back onto the first's neighbours): where 2h + 1 < n those travel to each
device from both sides, 2h hops instead of n − 1, and in the backward each neighbour's dK, dV
go home the way they came, summed as they pass (for a layer's window known at run time, a global
layer, 0, takes the whole ring instead).

`gathered_attention`: keys and values all-gathered in their (compute) dtype, each device attends
its own queries (in the plain order: device r holds the r-th chunk) against them, causal from
its offset; gradients of K, V come back as a reduce-scatter. No query is gathered and no work is
repeated, but the devices holding later chunks have more keys to see.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels.flash_attention import NEG, attention_parts, attention_parts_grads, flash_attention


def zigzag_order(length: int, n: int) -> np.ndarray:
  """Indices that lay out a row of `length` so that device r of n holds chunks r and 2n−1−r."""
  if length % (2 * n):
    raise ValueError(f'zigzag: length {length} must divide into 2×{n} chunks')
  c = length // (2 * n)
  chunks = [i for r in range(n) for i in (r, 2 * n - 1 - r)]
  return np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunks])


def _shift(tree, axis_name, n, step: int = 1):
  """Each device's tree to the next device of the ring (device r → r+step mod n), packed into one
  buffer of 32-bit words: XLA's GPU scheduler keeps one collective-permute in flight at a time,
  so a step's keys, values, segment ids and gradients must travel as one collective for all of
  them to overlap the step's kernel."""
  leaves, treedef = jax.tree.flatten(tree)
  words = [jax.lax.bitcast_convert_type(x.reshape(-1, 2) if x.dtype.itemsize == 2
                                        else x.reshape(-1), jnp.uint32) for x in leaves]
  sizes = np.cumsum([w.size for w in words])[:-1]
  sent = jax.lax.ppermute(jnp.concatenate(words), axis_name,
                          [(i, (i + step) % n) for i in range(n)])
  return jax.tree.unflatten(treedef, [
      jax.lax.bitcast_convert_type(w, x.dtype).reshape(x.shape)
      for w, x in zip(jnp.split(sent, sizes), leaves)])


class _Ring(NamedTuple):
  causal: bool
  axis_name: str
  block_q: int
  block_k: int
  interpret: bool | None
  reduce_dtype: str
  hopper: bool
  windowed: bool = False  # a window is an input (module docstring)
  window_mix: tuple | None = None  # flash_attention's, for the time model
  near: int = 0  # with a window: the devices each way whose keys it reaches (0: every device)
  uniform: bool = False  # the window is one for every call (not a layer's input, 0 for global)


def ring_attention(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL=None, *, causal: bool, axis_name: str,
                   block_q: int = 0, block_k: int = 0, interpret: bool | None = None,
                   reduce_dtype: str = 'float32', hopper: bool = False, window=None,
                   window_mix: tuple | None = None):
  """Attention of this device's queries to every device's keys along `axis_name` (module
  docstring). Causal expects the zigzag layout (zigzag_order). Segment ids mark packed documents,
  and travel with their keys. `reduce_dtype`: what dK, dV are summed in as they travel. hopper:
  every visit by our Hopper kernels (kernels/flash_attention_hopper.py). window, window_mix:
  flash_attention's (causal only)."""
  if window is not None and not causal:
    raise ValueError('ring_attention: a window is for causal attention (a local layer\'s)')
  uniform = isinstance(window, int)
  if uniform:
    window_mix = (window, 1.0)
  near = 0
  if window is not None and window_mix and window_mix[0] > 0:
    n, c = jax.lax.axis_size(axis_name), q_BLNH.shape[1] // 2
    hops = -(-(window_mix[0] - 1) // c)  # chunks back a query's window reaches
    near = hops if 2 * hops + 1 < n else 0
  st = _Ring(causal, axis_name, block_q, block_k, interpret, reduce_dtype, hopper,
             window is not None, window_mix, near, uniform)
  if window is not None:
    window = jnp.asarray(window, jnp.int32)
  return _ring(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL, window, st)


def _half(x, which: int, axis: int = 1):
  """The first (0) or second (1) of a device's two zigzag chunks along `axis`; None stays None."""
  if x is None:
    return None
  c = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, which * c, (which + 1) * c, axis=axis)


def _pad_front(x, axis, value=0):
  """x preceded by as many `value`s along axis: [c] → [2c]."""
  return jnp.concatenate([jnp.full_like(x, value), x], axis=axis)


def _pad_back(x, axis):
  return jnp.concatenate([x, jnp.zeros_like(x)], axis=axis)


def _visit_kind(st, r, s):
  """0: own chunks (causal); 1: all queries, first key chunk; 2: second query chunk, all keys."""
  if not st.causal:
    return None
  return jnp.where(s == r, 0, jnp.where(s < r, 1, 2))


def _chunks(r, s, n):
  """(this device's query chunks, the visiting key chunks): zigzag's indices of device r's and
  device s's two chunks."""
  return (r, 2 * n - 1 - r), (s, 2 * n - 1 - s)


def _pair_options(st, window, q_chunk, k_chunk, c):
  """One windowed chunk-pair's kernel options: causal from the offset between the chunks."""
  return dict(causal=True, q_offset=(q_chunk - k_chunk) * c, window=window,
              window_mix=st.window_mix)


def _forward_pairs(st, q, q_seg, kv, window, r, s, n):
  """(o fp32, lse) of this device's queries against one visit, windowed: four chunk-pairs."""
  k, v, kv_seg = kv
  parts = functools.partial(attention_parts, block_q=st.block_q, block_k=st.block_k,
                            interpret=st.interpret, hopper=st.hopper)
  c = q.shape[1] // 2
  (qa, qb), (ka, kb) = _chunks(r, s, n)
  halves = []
  for which, q_chunk in ((0, qa), (1, qb)):
    o = lse = None
    for part, k_chunk in ((0, ka), (1, kb)):
      o_i, lse_i = parts(_half(q, which), _half(k, part), _half(v, part),
                         segment_ids_BL=_half(q_seg, which),
                         kv_segment_ids_BS=_half(kv_seg, part),
                         **_pair_options(st, window, q_chunk, k_chunk, c))
      o, lse = (o_i, lse_i) if o is None else _merge(o, lse, o_i, lse_i)
    halves.append((o, lse))
  return (jnp.concatenate([halves[0][0], halves[1][0]], 1),
          jnp.concatenate([halves[0][1], halves[1][1]], 2))


def _forward_visit(st, q, q_seg, kv, kind):
  """(o fp32, lse) of this device's queries against one visiting (k, v, segment ids)."""
  k, v, kv_seg = kv
  parts = functools.partial(attention_parts, block_q=st.block_q, block_k=st.block_k,
                            interpret=st.interpret, hopper=st.hopper)
  if kind is None:
    return parts(q, k, v, causal=False, segment_ids_BL=q_seg, kv_segment_ids_BS=kv_seg)

  def own():
    return parts(q, k, v, causal=True, segment_ids_BL=q_seg, kv_segment_ids_BS=kv_seg)

  def first_keys():
    return parts(q, _half(k, 0), _half(v, 0), causal=False, segment_ids_BL=q_seg,
                 kv_segment_ids_BS=_half(kv_seg, 0))

  def second_queries():
    o, lse = parts(_half(q, 1), k, v, causal=False, segment_ids_BL=_half(q_seg, 1),
                   kv_segment_ids_BS=kv_seg)
    return _pad_front(o, 1), _pad_front(lse, 2, NEG)

  return jax.lax.switch(kind, (own, first_keys, second_queries))


def _merge(o, lse, o_i, lse_i):
  new = jnp.logaddexp(lse, lse_i)
  w, w_i = jnp.exp(lse - new), jnp.exp(lse_i - new)  # [B, N, L]
  to_BLN1 = lambda x: jnp.transpose(x, (0, 2, 1))[..., None]
  return o * to_BLN1(w) + o_i * to_BLN1(w_i), new


def _near_forward(q, k, v, seg, window, st):
  """(o, lse) of a window that reaches st.near devices each way: their keys only, sent to each
  device from both sides, 2·near hops instead of n − 1."""
  n, r = jax.lax.axis_size(st.axis_name), jax.lax.axis_index(st.axis_name)
  mine = (k, v, seg)
  o, lse = _forward_pairs(st, q, seg, mine, window, r, r, n)
  before = after = mine
  for d in range(1, st.near + 1):
    before, after = _shift(before, st.axis_name, n, 1), _shift(after, st.axis_name, n, -1)
    for kv, s in ((before, (r - d) % n), (after, (r + d) % n)):
      o, lse = _merge(o, lse, *_forward_pairs(st, q, seg, kv, window, r, s, n))
  return o, lse


def _ring_forward(q, k, v, seg, window, st):
  if st.near:  # a local layer's: its neighbours' keys; a global one's (0): the whole ring
    if st.uniform:
      return _near_forward(q, k, v, seg, window, st)
    return jax.lax.cond(window > 0, functools.partial(_near_forward, st=st),
                        functools.partial(_ring_forward, st=st._replace(near=0)),
                        q, k, v, seg, window)
  n, r = jax.lax.axis_size(st.axis_name), jax.lax.axis_index(st.axis_name)
  mine = (k, v, seg)

  def attend(kv, s):  # this device's queries against device s's keys
    if st.windowed:
      return _forward_pairs(st, q, seg, kv, window, r, s, n)
    return _forward_visit(st, q, seg, kv, _visit_kind(st, r, s))

  o, lse = attend(mine, r)
  if n == 1:
    return o, lse

  def visit(t, kv, o, lse):  # step t: the keys of device r − t
    o_t, lse_t = attend(kv, (r - t) % n)
    return _merge(o, lse, o_t, lse_t)

  def body(t, carry):
    kv, o, lse = carry
    following = _shift(kv, st.axis_name, n)  # in flight while this chunk is attended
    return (following, *visit(t, kv, o, lse))

  kv = _shift(mine, st.axis_name, n)
  kv, o, lse = jax.lax.fori_loop(1, n - 1, body, (kv, o, lse))
  return visit(n - 1, kv, o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, seg, window, st):
  return _ring_forward(q, k, v, seg, window, st)[0].astype(q.dtype)


def _ring_fwd(q, k, v, seg, window, st):
  o, lse = _ring_forward(q, k, v, seg, window, st)
  o = o.astype(q.dtype)
  return o, (q, k, v, seg, window, o, lse)


def _backward_pairs(st, q, q_seg, kv, window, o, lse, do, delta, r, s, n):
  """(dq fp32, dk, dv fp32) of this device's queries' loss through one windowed visit."""
  k, v, kv_seg = kv
  grads = functools.partial(attention_parts_grads, block_q=st.block_q, block_k=st.block_k,
                            interpret=st.interpret, hopper=st.hopper)
  c = q.shape[1] // 2
  (qa, qb), (ka, kb) = _chunks(r, s, n)
  dq, dk, dv = [None, None], [None, None], [None, None]
  add = lambda a, b: b if a is None else a + b
  for which, q_chunk in ((0, qa), (1, qb)):
    for part, k_chunk in ((0, ka), (1, kb)):
      dq_i, dk_i, dv_i = grads(
          _half(q, which), _half(k, part), _half(v, part), _half(o, which), _half(lse, which, 2),
          _half(do, which), _half(delta, which, 2), segment_ids_BL=_half(q_seg, which),
          kv_segment_ids_BS=_half(kv_seg, part),
          **_pair_options(st, window, q_chunk, k_chunk, c))
      dq[which], dk[part], dv[part] = add(dq[which], dq_i), add(dk[part], dk_i), add(dv[part], dv_i)
  return tuple(jnp.concatenate(x, 1) for x in (dq, dk, dv))


def _backward_visit(st, q, q_seg, kv, o, lse, do, delta, kind):
  """(dq fp32, dk, dv fp32) of this device's queries' loss through one visiting (k, v)."""
  k, v, kv_seg = kv
  grads = functools.partial(attention_parts_grads, block_q=st.block_q, block_k=st.block_k,
                            interpret=st.interpret, hopper=st.hopper)
  if kind is None:
    return grads(q, k, v, o, lse, do, delta, causal=False, segment_ids_BL=q_seg,
                 kv_segment_ids_BS=kv_seg)

  def own():
    return grads(q, k, v, o, lse, do, delta, causal=True, segment_ids_BL=q_seg,
                 kv_segment_ids_BS=kv_seg)

  def first_keys():
    dq, dk, dv = grads(q, _half(k, 0), _half(v, 0), o, lse, do, delta, causal=False,
                       segment_ids_BL=q_seg, kv_segment_ids_BS=_half(kv_seg, 0))
    return dq, _pad_back(dk, 1), _pad_back(dv, 1)

  def second_queries():
    dq, dk, dv = grads(_half(q, 1), k, v, _half(o, 1), _half(lse, 1, 2), _half(do, 1),
                       _half(delta, 1, 2), causal=False, segment_ids_BL=_half(q_seg, 1),
                       kv_segment_ids_BS=kv_seg)
    return _pad_front(dq, 1), dk, dv

  return jax.lax.switch(kind, (own, first_keys, second_queries))


def _ring_bwd(st, residuals, do):
  q, k, v, seg, window, o, lse = residuals
  delta = jnp.einsum('blnh,blnh->bnl', o.astype(jnp.float32), do.astype(jnp.float32))
  if st.near:
    if st.uniform:
      grads = _near_backward(st, q, k, v, seg, window, o, lse, do, delta)
    else:
      grads = jax.lax.cond(window > 0, functools.partial(_near_backward, st),
                           functools.partial(_full_backward, st._replace(near=0)),
                           q, k, v, seg, window, o, lse, do, delta)
  else:
    grads = _full_backward(st, q, k, v, seg, window, o, lse, do, delta)
  dq, dk, dv = grads
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


def _near_backward(st, q, k, v, seg, window, o, lse, do, delta):
  """_near_forward's gradients: the neighbours' keys sent again, and each neighbour's dK, dV
  summed on its way home (a device's share for the keys d hops away travels back d hops,
  picking up the nearer ones' shares as it passes them)."""
  n, r = jax.lax.axis_size(st.axis_name), jax.lax.axis_index(st.axis_name)
  acc = jnp.dtype(st.reduce_dtype)
  mine = (k, v, seg)
  dq, dk, dv = _backward_pairs(st, q, seg, mine, window, o, lse, do, delta, r, r, n)
  before, after = [mine], [mine]
  for _ in range(st.near):
    before.append(_shift(before[-1], st.axis_name, n, 1))
    after.append(_shift(after[-1], st.axis_name, n, -1))
  home = {}
  for side, kvs, sign in (('before', before, -1), ('after', after, 1)):
    travelling = None
    for d in range(st.near, 0, -1):
      dq_d, dk_d, dv_d = _backward_pairs(st, q, seg, kvs[d], window, o, lse, do, delta, r,
                                         (r + sign * d) % n, n)
      dq = dq + dq_d
      share = (dk_d.astype(acc), dv_d.astype(acc))
      travelling = share if travelling is None else jax.tree.map(jnp.add, travelling, share)
      travelling = _shift(travelling, st.axis_name, n, sign)  # a hop towards the keys' owners
    home[side] = travelling
  dk = dk.astype(acc) + home['before'][0] + home['after'][0]
  dv = dv.astype(acc) + home['before'][1] + home['after'][1]
  return dq, dk, dv


def _full_backward(st, q, k, v, seg, window, o, lse, do, delta):
  """Step t (0 … n−1) sees the keys of device r−1−t, so a chunk's dK, dV start next to it and
  end on its owner after n−1 hops, the last step being the device's own keys."""
  n, r = jax.lax.axis_size(st.axis_name), jax.lax.axis_index(st.axis_name)
  acc = jnp.dtype(st.reduce_dtype)
  mine = (k, v, seg)

  def visit(t, kv, dq, dkv):
    source = r if t is None else (r - 1 - t) % n
    if st.windowed:
      dq_t, dk_t, dv_t = _backward_pairs(st, q, seg, kv, window, o, lse, do, delta, r, source, n)
    else:
      dq_t, dk_t, dv_t = _backward_visit(st, q, seg, kv, o, lse, do, delta,
                                         _visit_kind(st, r, source))
    dkv_t = (dk_t.astype(acc), dv_t.astype(acc))
    return dq + dq_t, dkv_t if dkv is None else jax.tree.map(jnp.add, dkv, dkv_t)

  dq = jnp.zeros(q.shape, jnp.float32)
  if n == 1:
    dq, dkv = visit(None, mine, dq, None)
  else:
    kv = _shift(mine, st.axis_name, n)  # step 0: the keys of device r − 1
    following = _shift(kv, st.axis_name, n) if n > 2 else None
    dq, dkv = visit(0, kv, dq, None)

    def body(t, carry):  # steps 1 … n−3: the next keys and this chunk's dK, dV in flight
      kv, dq, dkv = carry
      following, dkv = _shift((kv, dkv), st.axis_name, n)
      return (following, *visit(t, kv, dq, dkv))

    if n > 2:
      kv, dq, dkv = jax.lax.fori_loop(1, n - 2, body, (following, dq, dkv))
      dq, dkv = visit(n - 2, kv, dq, _shift(dkv, st.axis_name, n))
    dq, dkv = visit(n - 1, mine, dq, _shift(dkv, st.axis_name, n))  # its own keys: home
  dk, dv = dkv
  return dq, dk, dv


_ring.defvjp(_ring_fwd, _ring_bwd)


def gathered_attention(q_BLNH, k_BLKH, v_BLKH, segment_ids_BL=None, *, causal: bool,
                       axis_name: str, block_q: int = 0, block_k: int = 0,
                       interpret: bool | None = None, hopper: bool = False, window=None,
                       window_mix=None):
  """This device's queries against the keys and values of every device along `axis_name`,
  all-gathered (module docstring); the plain layout, device r holding the r-th chunk. hopper: by
  our Hopper kernels, causal from the device's offset as the Triton kernel. window, window_mix:
  flash_attention's (a local layer's: the kernel skips the gathered blocks outside it)."""
  gather = lambda x: None if x is None else jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
  offset = jax.lax.axis_index(axis_name) * q_BLNH.shape[1] if causal else None
  return flash_attention(q_BLNH, gather(k_BLKH), gather(v_BLKH), causal=causal,
                         segment_ids_BL=segment_ids_BL, kv_segment_ids_BS=gather(segment_ids_BL),
                         q_offset=offset, block_q=block_q, block_k=block_k, interpret=interpret,
                         hopper=hopper, window=window, window_mix=window_mix)
