"""What each cache kind (model/kv_cache.py) keeps per token and what it costs a trained model:
the validation documents decoded against each kind of cache, their loss and bits per byte beside
the full cache's, and how many greedy tokens stay those of the full cache.

  python train.py --config=configs/default.py --config.workdir=/tmp/meshlm-default   # once
  python -m benchmarks.kv_cache --workdir=/tmp/meshlm-default

Each row (--rows of seq_len tokens: the validation documents cut into consecutive windows, as
packing cuts them) goes through `Transformer.decode` in one call against an empty cache of the
kind: every position's query reads every earlier position's
keys and values from the cache as stored, so a quantized cache gives the loss that decoding with
it would (each next token's loss with the text before it in the cache), not the training
forward's. Bits per byte counts the bytes the targets stand for (training/evaluation.py).

Greedy agreement: --prompts rows' first --prompt_tokens tokens continued greedily for
--new_tokens with each kind; the share of new tokens equal to the full cache's, position by
position, and how many come before the first that differs (mean over prompts).

Bytes are per token and layer, from the kind's shapes (tests check them against the arrays
allocated), so they hold for any device. The quality figures are the model's on this machine's
CPU; a GPU computes the same arithmetic.
"""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import generate as gen
from model import kv_cache
from training import loop, sampling


def windows(loaded, count: int, length: int) -> list[np.ndarray]:
  """Up to `count` rows of `length` tokens: the validation documents in order, each cut into
  consecutive windows (a document's first starts with its BOS), as packing cuts them."""
  _, docs = loop.load_data(loaded.config.data, loaded.tokenizer)
  out = []
  for i in range(len(docs.validation)):
    ids = np.asarray(docs.validation.get([i])[0])
    ids = ids[0] if ids.ndim == 2 else ids  # weighted documents: their ids
    out += [ids[s:s + length].astype(np.int32) for s in range(0, len(ids) - 1, length)]
    if len(out) >= count:
      break
  return out[:count]


def losses(model, rows: list[np.ndarray], kind: str, token_bytes: np.ndarray, pad_id: int):
  """(nats, tokens, bytes) of predicting each row's tokens after its first, decoded against a
  cache of `kind`."""
  L = max(map(len, rows))
  tokens = np.full((len(rows), L), pad_id, np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  valid = np.arange(L)[None, 1:] < np.array([len(r) for r in rows])[:, None]
  graphdef, state = nnx.split(model)

  @jax.jit
  def nll(state, tokens):
    m = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(L), tokens.shape)
    logits, _ = m.decode(tokens, positions, m.init_cache(*tokens.shape, kind))
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

  nats = np.asarray(nll(state, tokens), np.float64)
  targets = tokens[:, 1:]
  return (float((nats * valid).sum()), int(valid.sum()),
          float((token_bytes[targets] * valid).sum()))


def agreement(new: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
  """(share of positions equal, mean count of new tokens before the first that differs)."""
  same = new == reference
  before = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
  return float(same.mean()), float(before.mean())


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--workdir', default='/tmp/meshlm-default')
  parser.add_argument('--rows', type=int, default=128)
  parser.add_argument('--prompts', type=int, default=16)
  parser.add_argument('--prompt_tokens', type=int, default=64)
  parser.add_argument('--new_tokens', type=int, default=64)
  args = parser.parse_args(argv)
  loaded = sampling.load(args.workdir)
  cfg, tok = loaded.model.cfg, loaded.tokenizer
  rows = windows(loaded, args.rows, loaded.config.seq_len)
  prompts = [list(r[:args.prompt_tokens]) for r in rows[:args.prompts]]
  print(f'# {loaded.checkpoint}: {len(rows)} rows of validation text, {sum(map(len, rows)):,} '
        f'tokens; d_model {cfg.d_model}, {cfg.n_kv_heads} kv heads × {cfg.head_dim}, compute '
        f'{cfg.dtype.name}')
  results, reference = {}, None
  for kind in kv_cache.KINDS:
    nats, tokens, n_bytes = losses(loaded.model, rows, kind, tok.token_bytes(), tok.pad_id)
    new = gen.generate(loaded.model, prompts, args.new_tokens, cache=kind, pad_id=tok.pad_id,
                       vocab_size=tok.vocab_size)
    reference = new if reference is None else reference
    same, before = agreement(new, reference)
    results[kind] = {'bytes_per_token_layer': kv_cache.bytes_per_token(cfg, kind),
                     'loss': nats / tokens, 'bits_per_byte': nats / math.log(2) / n_bytes,
                     'greedy_same': same, 'greedy_tokens_before_change': before}
  full = results['full']
  print(f'\n{"cache":8} {"bytes/token/layer":>18} {"of full":>8} {"loss":>8} {"bits/byte":>10} '
        f'{"Δ bits/byte":>12} {"greedy same":>12} {"first change":>13}')
  for kind, r in results.items():
    r['bytes_of_full'] = r['bytes_per_token_layer'] / full['bytes_per_token_layer']
    r['bits_per_byte_change'] = r['bits_per_byte'] / full['bits_per_byte'] - 1
    print(f'{kind:8} {r["bytes_per_token_layer"]:>18,} {r["bytes_of_full"]:>8.3f} '
          f'{r["loss"]:>8.4f} {r["bits_per_byte"]:>10.4f} {100 * r["bits_per_byte_change"]:>+11.3f}% '
          f'{100 * r["greedy_same"]:>11.1f}% {r["greedy_tokens_before_change"]:>13.1f}')
  print(json.dumps({'benchmark': 'kv_cache', 'checkpoint': loaded.checkpoint,
                    'rows': len(rows), 'tokens': int(sum(map(len, rows))) - len(rows),
                    'device': jax.devices()[0].device_kind, 'kinds': results}))


if __name__ == '__main__':
  main()
