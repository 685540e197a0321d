"""Text from a trained run: `load(path)` restores a checkpoint's model and tokenizer (the config
saved with the checkpoint says which; its files are read from the run's copy in the workdir), and
`complete(...)` continues prompts with the KV-cached sampler in inference/generate.py. sample.py is
the command.

The parameters are sharded FSDP-style over this process's devices when their dimensions divide,
else kept on one device: sampling needs neither the training mesh nor its batch size.
"""

import dataclasses
import pathlib

import jax
from flax import nnx

from configs import base, effects, fields
from data import chat, tokenizers
from inference.generate import Sampling, generate
from inference.speculate import speculate
from model import Transformer
from model import kv_cache
from runtime import checkpoint as checkpoint_lib
from runtime import faults
import sharding
from training import settings
from training.state import attention_runs_on
from configs.base import Run

ONE_AXIS = {axis: 1 for axis in sharding.AXES}  # sampling splits parameters over fsdp at most
SAVED = (*effects.MODEL, 'data', 'numerics')  # the kinds of setting a checkpoint's model takes
# How the run laid its training out over its devices: numerics, but of the step, not the model.
LAYOUT = frozenset(f for f in effects.of_kinds(('numerics',)) if not f.startswith('model.'))
MAX_LEN_FACTOR = 16  # --max_len past the trained seq_len, at most this many times it


@dataclasses.dataclass
class Loaded:
  model: Transformer
  tokenizer: tokenizers.Tokenizer
  run: Run  # the run's settings, as saved, resolved here
  checkpoint: str  # the step directory it came from
  init_from: str = ''  # where the run started (config.init_from as saved): an adapter's base
  chat_template: str | None = None  # the template it rendered its records with, if it kept one


def check_arguments(max_new_tokens: int, temperature: float, top_k: int, max_len: int,
                    cache: str = 'full', top_p: float = 1.0) -> None:
  """ValueError naming the flag, before anything is loaded."""
  if cache not in kv_cache.KINDS:
    raise ValueError(f'--kv_cache={cache!r}: one of {", ".join(kv_cache.KINDS)} '
                     '(docs/sampling.md)')
  if max_new_tokens < 1:
    raise ValueError(f'--max_new_tokens={max_new_tokens} must be at least 1')
  try:
    Sampling(temperature, top_k, top_p).checked()
  except ValueError as e:
    raise ValueError(f'--{e}') from None
  if max_len < 0:
    raise ValueError(f'--max_len={max_len} must be ≥ 0 (0: the seq_len the model was trained at)')


def load(path: str, step: int | None = None) -> Loaded:
  """A run's workdir (its newest checkpoint, or `step`), its checkpoints/ dir, or one
  checkpoints/<step>."""
  directory, step = checkpoint_lib.step_directory(path, setting='--workdir', step=step)
  checkpointer = checkpoint_lib.Checkpointer(directory, read_only=True)
  saved = checkpointer.saved_config(step)
  checkpointer.close()
  if not saved:
    raise ValueError(f'checkpoint {directory / str(step)} holds no readable config; point at '
                     'another step')
  # The run's model, data and numerics, as configs/base.py: EFFECTS declares them (what this
  # machine runs, logs or plans is its own; a setting an older meshlm lacked keeps its default).
  # Its layout (mesh, partition, optimizer tiers, microbatches) is its training's: sampling
  # lays the model out on this machine's devices.
  config = base.get_config()
  for field in (f for f in effects.of_kinds(SAVED) if f not in LAYOUT):
    if (value := effects.get(saved, field, fields.UNSAVED)) is not fields.UNSAVED:
      section, _, key = field.rpartition('.')
      (config[section] if section else config)[key] = value
  config.init_from = ''  # the run's model settings are saved: where it started is not needed
  if kept := tokenizers.kept_model(directory.parent, config.data.tokenizer,
                                   config.data.tokenizer_model):  # the run's copies, wherever
    config.data.tokenizer_model = kept  # the originals went
  if (kept := directory.parent / chat.KEPT).is_file():
    config.data.chat_template = str(kept)
  config.workdir = str(directory.parent)
  if not attention_runs_on(config.model.attention, jax.local_devices()[0]):
    config.model.attention = 'auto'  # the same function, in the kernel this machine would choose
  run = settings.resolve(config)
  check_copies(run, saved.get('trained_on') or {}, directory / str(step))
  model_cfg = run.model.dropless()  # no token's output depends on
  # the other rows of its batch
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
  devices = jax.local_devices()
  try:
    mesh = sharding.make_mesh(dict(ONE_AXIS, fsdp=-1), devices)
    shardings = sharding.param_shardings(abstract, mesh)
  except ValueError:  # a dimension does not divide by the device count
    mesh = sharding.make_mesh(ONE_AXIS, devices[:1])
    shardings = sharding.param_shardings(abstract, mesh)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  params, step_dir = checkpoint_lib.restore_params(str(directory / str(step)), abstract,
                                                   run.model, setting='--workdir')
  return Loaded(nnx.merge(graphdef, params), run.tokenizer, run, str(step_dir),
                saved.get('init_from', ''), chat.kept_template(directory.parent))


def check_copies(run, recorded: dict, checkpoint: pathlib.Path) -> None:
  """The run's own copies of its tokenizer and chat template (in its workdir) against the
  fingerprints `checkpoint` records of what it trained with (runtime/checkpoint.py: TRAINED_ON),
  before anything reads or ships them: a model knows only the ids and the rendering it learnt."""
  workdir = checkpoint.parent.parent
  for key, now, copy in (
      ('tokenizer', run.tokenizer.fingerprint, workdir / tokenizers.KEPT),
      ('chat_template', run.template.digest if run.template else '', workdir / chat.KEPT)):
    if recorded.get(key) and now and now != recorded[key]:
      what, setting = checkpoint_lib.TRAINED_ON[key]
      named = copy if copy.exists() else setting
      raise faults.Fault(f'{named}: the {what} is {now} now, but checkpoint {checkpoint} was '
                         f'trained with {recorded[key]}: the run\'s own copy was changed. Put '
                         'back the files the run trained with')


def chat_prompt(loaded: Loaded, message: str) -> str:
  """`message` as a user's turn in the run's chat template (the one it kept, else
  config.data.chat_template: the tokenizer's own or the fallback), with the generation prompt:
  what a chat server sends."""
  template = chat.template_source(loaded.tokenizer, loaded.run.data.chat_template)
  try:
    return chat.render(template.source, [{'role': 'user', 'content': message}],
                       getattr(loaded.tokenizer, 'special_tokens', {}),
                       add_generation_prompt=True)
  except chat.TemplateError as e:
    raise ValueError(f'--chat: the run\'s chat template ({template.origin}) fails on the prompt '
                     f'{message[:60]!r}: {e}; ask without --chat, or another prompt') from None


def complete(loaded: Loaded, prompts: list[str], max_new_tokens: int, *, temperature: float = 0.8,
             top_k: int = 40, top_p: float = 1.0, seed: int = 0, max_len: int = 0,
             cache: str = 'full', speculative: bool = False, report=None,
             chat_prompts: bool = False) -> list[str]:
  """Each prompt's continuation (text after the prompt), up to the end of a document or
  `max_new_tokens` tokens. Every prompt starts as a document does, after BOS (a prompt whose
  text begins with it is not given a second); with `chat_prompts` (chat_prompt's) each starts
  as its template rendered it, as the run's conversations did.

  Prompt and continuation together are at most `max_len` tokens (0: the seq_len the model was
  trained at, beyond which its positions are untried); a longer max_len must leave the cache
  room in memory. Both are checked before anything is allocated. `cache` is what decoding keeps
  of past tokens (model/kv_cache.py: KINDS). `speculative`: decode with the model's draft heads
  (inference/speculate.py; the same text greedy, the same distribution sampled), if it has them;
  `report(line)` then gets a line of how far their guesses went."""
  tok = loaded.tokenizer
  ids = [list(tok.encode(p.encode())) for p in prompts]
  ids = [row if chat_prompts or row[:1] == [tok.bos_id] else [tok.bos_id, *row] for row in ids]
  return continue_ids(loaded, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, seed=seed, max_len=max_len, cache=cache,
                      speculative=speculative, report=report)


def continue_ids(loaded: Loaded, ids: list[list[int]], max_new_tokens: int, *,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 1.0, seed: int = 0,
                 max_len: int = 0, cache: str = 'full', speculative: bool = False, report=None,
                 pad_to: int = 1) -> list[str]:
  """complete's continuations of prompts given as token ids (each as the model is to read it:
  BOS first where a document's start is meant). `pad_to`: the prompts' padded length is a
  multiple of it (fewer shapes, fewer compiles, for callers with many batches)."""
  tok = loaded.tokenizer
  if top_k > tok.vocab_size:
    raise ValueError(f'--top_k={top_k} is more than the {tok.vocab_size:,} tokens of the run\'s '
                     f'{tok.name} tokenizer; give at most {tok.vocab_size} (0: all of them)')
  heads = loaded.model.cfg.draft_heads if speculative else 0
  check_length(loaded, len(ids), max(map(len, ids)) + max_new_tokens, max_new_tokens, max_len,
               cache, heads)
  args = dict(key=jax.random.key(seed), temperature=temperature, top_k=top_k, top_p=top_p,
              eos_id=tok.eos_id,
              pad_id=tok.pad_id, vocab_size=tok.vocab_size, cache=cache)
  if heads:
    new, stats = speculate(loaded.model, ids, max_new_tokens, **args)
    if report:
      report(speculation_summary(stats))
  else:
    new = generate(loaded.model, ids, max_new_tokens, pad_to=pad_to, **args)
  texts = []
  for row in new.tolist():
    if tok.eos_id in row:
      row = row[:row.index(tok.eos_id)]
    texts.append(tok.decode(row))
  return texts


def speculation_summary(stats: dict) -> str:
  """One line of speculate's stats: tokens per base forward, each head's guesses kept."""
  forwards = max(int(stats['forwards'].sum()), 1)
  kept = ' / '.join(f'{100 * n / forwards:.0f}%' for n in stats['accepted'].sum(0))
  return (f'# speculative: {stats["tokens"].sum() / forwards:.2f} tokens per base forward '
          f'({forwards:,} forwards); guesses kept, head by head: {kept}')


def check_length(loaded: Loaded, rows: int, length: int, max_new_tokens: int, max_len: int,
                 cache: str = 'full', draft_heads: int = 0):
  """ValueError naming the flag, if `rows` sequences of `length` tokens go past max_len (0: the
  trained seq_len) or, for an explicit max_len, their cache of kind `cache` past the memory there
  is (with room for `draft_heads` guesses and the token before them, speculating)."""
  limit, trained = max_len or loaded.run.seq_len, loaded.run.seq_len
  if max_len > MAX_LEN_FACTOR * trained:
    raise ValueError(f'--max_len={max_len:,} is more than {MAX_LEN_FACTOR}× the seq_len the model '
                     f'was trained at ({trained:,}): positions that far are ones it has never '
                     f'seen, and each token would attend over all {max_len:,} slots; give at most '
                     f'--max_len={MAX_LEN_FACTOR * trained}')
  bound = f'--max_len={max_len}' if max_len else f'the seq_len it was trained at, {limit}'
  if length - max_new_tokens >= limit:
    raise ValueError(f'the longest prompt is {length - max_new_tokens:,} tokens, which leaves no '
                     f'room for one more within {bound}; shorten it, or raise --max_len (at most '
                     f'{MAX_LEN_FACTOR}× the trained seq_len)')
  if length > limit:
    raise ValueError(f'--max_new_tokens={max_new_tokens}: the longest prompt and its continuation '
                     f'make {length:,} tokens, more than {bound}; lower --max_new_tokens, or '
                     'raise --max_len to sample past the trained length')
  if max_len:
    needs = cache_bytes(loaded.model.cfg, cache, rows, length + (draft_heads + 1 if draft_heads
                                                                  else 0), ahead=draft_heads)
    device = jax.local_devices()[0]
    free = ((device.memory_stats() or {}).get('bytes_limit')
            or faults.available_host_memory())  # CPU: the host's
    if needs > free:
      raise ValueError(f'--max_len={max_len}: the {cache} cache of {rows} prompt(s) × {length:,} '
                       f'tokens needs {needs / 2**30:,.1f} GiB, more than the '
                       f'{free / 2**30:,.1f} GiB there is; lower --max_len or --max_new_tokens, '
                       'give fewer prompts, or a smaller --kv_cache (docs/sampling.md)')


def cache_bytes(cfg, cache: str, rows: int, length: int, ahead: int = 0) -> int:
  """What decoding `rows` sequences of `length` tokens holds for a cache of kind `cache` (local
  layers' rings with room for `ahead` guesses): the scan over new tokens holds the cache it
  reads and the one it writes, plus an X cache's constants."""
  return (2 * kv_cache.stored_bytes(cfg, cache, rows, length, ahead)
          + kv_cache.fixed_bytes(cfg, cache))
