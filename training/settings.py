"""From a raw config to a Run (configs/base.py): the first thing every entry point does (train.py
through `loop.run`, the dry run, sample.py through `sampling.load`, the benchmarks, a notebook),
and the only place the raw config is read.

  run = settings.resolve(config)

Resolving checks every field (those configs/base.py declares, no others; each value against its
declaration: a number finite and within its range, a choice among its choices) and fills in what
the config leaves open: `config.init_from` gives the base model's settings (and the tokenizer) from
where it starts, a Hugging Face checkpoint's config.json or a meshlm run's saved config
(`with_start`; another tokenizer than its own is refused); the tokenizer and the chat template are
a resumed run's own copies (`owned` of data/tokenizers.py and data/chat.py);
`config.model.vocab_size=0` becomes the tokenizer's size, padded. Each section is then built into
its typed form, which checks what crosses its fields (configs/base.py: ModelConfig, MeshConfig, …),
and `check_sections` judges what crosses sections and what needs the kernels' or GPUs' tables (our
Hopper kernel's head dims, config.plan.target). It joins the job's other processes
(runtime/distributed.py), finds the run's Target (planning/target.py: the devices its programs are
compiled for), and lays the run out: `config.model.attention='auto'` becomes a kernel, and
`config.mesh.auto` runs the layout search (training/layout.py);
`config.model.grad_reduce_dtype='auto'` becomes a dtype (`with_reduce_dtype`). Every bad setting is
a ValueError naming `config.<field>` and the fix. What depends on the devices' shapes (the mesh
against the model's dimensions, cuDNN on a GPU, pinned host memory) is `training.state.build`'s,
which raises `sharding.MeshMismatch` for a mesh the model or batch cannot use; files (data,
checkpoints, the workdir) are checked where they are opened, before anything is written.
"""


import math

import jax

from configs import base, effects
from configs import fields
from data import chat, tokenizers, tokens
from interop import huggingface
from kernels.attention import hopper_refuses
from planning import target as target_lib
from runtime import checkpoint, distributed
from runtime import workdir as workdir_lib
from sharding import hierarchical
import sharding
from training import layout
from configs.base import HF, RANDOM, RUN, Run, Start


def resolve(config, devices=None, log=None) -> Run:
  """The Run of `config` (module docstring) on `devices` (default: this process's, once the job's
  processes have joined). `log`: where the layout search reports (default: print, on process 0).

    run = settings.resolve(config)
  """
  values = fields.checked(config)
  start = started_from(values['init_from'])
  values = with_start(values, start)
  workdir = values['workdir']
  data = base.DataConfig(**values['data'])
  # A resumed run's own copies of its tokenizer and chat template, as its checkpoints record them.
  recorded = checkpoint.recorded_trained_on(workdir) if workdir else {}
  tokenizer = tokenizers.owned(data, workdir, recorded.get('tokenizer', ''))
  template = chat.owned(tokenizer, data, workdir, recorded.get('chat_template', ''))
  check_start_tokenizer(start, tokenizer)
  values['model']['vocab_size'] = tokenizers.model_vocab_size(values['model']['vocab_size'],
                                                              tokenizer, values['init_from'])
  run = Run.of(values, tokenizer=tokenizer, template=template, start=start)
  check_sections(run)
  distributed.initialize(run.distributed)  # before anything touches a device
  devices = jax.devices() if devices is None else list(devices)
  run = run.replace(target=target_lib.resolve(run.plan, run.dry_run, devices))
  run = with_reduce_dtype(run)
  if run.partition.hierarchical and not run.mesh.auto:  # the search checks its meshes
    hierarchical.check_nodes(run.partition, sharding.mesh_shape(run.mesh.sizes,
                                                                run.target.n_devices),
                             run.target.gpus_per_node)
  if not run.mesh.auto or run.target.in_child:  # the GPU compiler's process searches
    return layout.with_attention(run)
  if log is None:
    log = print if jax.process_index() == 0 else lambda *_: None
  return layout.choose(run, log)[0]  # the mesh shape the time model ranks first


def with_reduce_dtype(run: Run) -> Run:
  """`config.model.grad_reduce_dtype='auto'` made concrete: where the programs compile for
  several GPUs, the compute dtype, as MaxText's gradients are (docs/precision.md); on one GPU
  float32, as no gradient crosses a device there (bf16 only rounded it, and planned more memory
  and time: docs/precision.md); on CPUs float32: XLA's
  CPU collectives sum bf16 in fp32 anyway, so a bf16 reduction there only rounds and converts,
  and across processes (Gloo) its bf16 reduce-scatters time out."""
  if run.model.grad_reduce_dtype != 'auto':
    return run
  crossing = run.target.on_gpu and run.target.n_devices > 1
  return run.replace(model={'grad_reduce_dtype': run.model.compute_dtype if crossing
                            else 'float32'})




def started_from(init_from: str) -> Start:
  """Where `config.init_from` starts the run: a Hugging Face checkpoint's directory, a meshlm
  run (its saved config and workdir), or fresh parameters."""
  if hf := huggingface.directory(init_from):
    return Start(init_from, HF, hf)
  if init_from in ('', RANDOM):
    return Start(init_from)
  saved, workdir = checkpoint.saved_run(init_from)
  return Start(init_from, RUN, workdir, saved)


def with_start(values: dict, start: Start) -> dict:
  """`values` whose base model is the checkpoint's it starts from (a Hugging Face model's
  config.json, or a meshlm run's saved config, whose settings of the kinds configs/effects.py:
  FROM_CHECKPOINT it takes), with its tokenizer and chat template where the config leaves the
  defaults. A setting given other than its default and the checkpoint's is an error naming both:
  its parameters were trained for that model."""
  defaults = base.get_config().to_dict()
  if start.kind == HF:
    return _with_hf_start(values, start.path, defaults)
  if start.kind != RUN or not start.saved:  # unreadable: the checkpoint's own check names it
    return values
  saved = start.saved
  for field in effects.of_kinds(effects.FROM_CHECKPOINT):
    value, given = effects.get(saved, field, fields.UNSAVED), effects.get(values, field)
    if value is fields.UNSAVED or value == given:
      continue
    if given != effects.get(defaults, field):
      raise ValueError(
          f'config.{field}={given!r}, but config.init_from={start.init_from} was trained with '
          f'{value!r}; drop the setting (the checkpoint decides it) or start from another '
          'checkpoint')
    section, key = field.rsplit('.', 1)
    values[section][key] = value
  data = values['data']
  kept = effects.get(saved, 'data.tokenizer', 'byte')
  if data['tokenizer'] == 'byte' and kept != 'byte':  # the default: take the run's own
    model = saved['data']['tokenizer_model']
    data['tokenizer'] = kept
    data['tokenizer_model'] = tokenizers.kept_model(start.path, kept, model) or model
  # The chat template it rendered its records with, where the config leaves the default (which
  # would take the tokenizer's own: not the one the run learnt, if it named another).
  if data['chat_template'] == 'auto' and (template := start.path / chat.KEPT).is_file():
    data['chat_template'] = str(template)
  return values


def _with_hf_start(values: dict, path, defaults: dict) -> dict:
  """config.model from a Hugging Face checkpoint's config.json, and its tokenizer.json where
  config.data.tokenizer is left at byte."""
  model, data = values['model'], values['data']
  for field, value in huggingface.model_settings(path).items():
    given = model[field]
    if given != value and given != defaults['model'][field]:
      raise ValueError(
          f'config.model.{field}={given!r}, but config.init_from={values["init_from"]} has '
          f'{huggingface.source(field, value)} in its config.json; drop the setting (the '
          'checkpoint decides it) or start from another checkpoint')
    model[field] = value
  if data['tokenizer'] == 'byte':
    if not (path / 'tokenizer.json').is_file():
      # Its embeddings were trained on its own tokenizer's ids: never on bytes, in silence.
      raise ValueError(
          f"config.init_from={values['init_from']}: {path} has no tokenizer.json, and "
          "config.data.tokenizer='byte' would feed its embeddings byte ids; write one beside it "
          f"(transformers: AutoTokenizer.from_pretrained('{path}').save_pretrained('{path}')), "
          'or name its tokenizer: --config.data.tokenizer=hf '
          '--config.data.tokenizer_model=…/tokenizer.json')
    data['tokenizer'], data['tokenizer_model'] = 'hf', str(path / 'tokenizer.json')
  return values


def check_start_tokenizer(start: Start, tokenizer) -> None:
  """ValueError if the checkpoint the run starts from, a Hugging Face model or a meshlm run, was
  trained with another tokenizer than `tokenizer` (its embeddings are those ids'), naming both."""
  if start.kind == HF and (start.path / 'tokenizer.json').is_file():
    theirs = tokenizers.HFTokenizer(str(start.path / 'tokenizer.json'))
  elif start.kind != RUN or not start.saved or 'data' not in start.saved:
    return
  else:
    data = start.saved['data']
    kind, model = data.get('tokenizer', 'byte'), data.get('tokenizer_model', '')
    try:
      theirs = tokenizers.named(kind, tokenizers.kept_model(start.path, kind, model) or model)
    except ValueError:  # its files are gone: the vocabulary check is what is left
      return
  if theirs.fingerprint != tokenizer.fingerprint:
    raise ValueError(
        f'config.init_from={start.init_from} was trained with the {theirs.name} tokenizer '
        f'{theirs.fingerprint}, and config.data names {tokenizer.name} {tokenizer.fingerprint}: '
        'its embeddings are the first one\'s ids. Leave config.data.tokenizer at byte to take '
        "the run's own, or name the same files")




def check_sections(run: Run) -> None:
  """What crosses a Run's sections, which no device or file decides: ValueError naming the
  setting. (Each section checked itself when it was built; the numbers were configs/fields.py's.)"""
  model = run.model
  if model.attention == 'hopper' and (why := hopper_refuses(model.head_dim,
                                                                     model.compute_dtype)):
    raise ValueError(f"config.model.attention='hopper' cannot run {why}; use "
                     '--config.model.attention=pallas (ours in Triton) or auto')
  target_lib.check(run.plan)
  if model.draft_heads and model.draft_heads + 2 > run.seq_len:
    raise ValueError(f'config.model.draft_heads={model.draft_heads}: head k guesses the token '
                     f'k + 1 after each position, which needs rows of at least '
                     f'{model.draft_heads + 2} tokens, and config.seq_len={run.seq_len}; '
                     'lower draft_heads or raise seq_len')
  if model.remat_policy in base.KEEPS_KERNEL and model.attention == 'xla':  # named so; auto's choice
    # on a CPU keeps what its dots twin keeps: the same program
    twin = model.remat_policy.replace('_attention', '')
    raise ValueError(f"config.model.remat_policy='{model.remat_policy}' keeps an attention "
                     "kernel's output and softmax statistics, and attention='xla' runs none; set "
                     f"--config.model.attention=cudnn or pallas, or remat_policy='{twin}'")
  if run.mesh.stage != 1 and not run.mesh.auto and run.differentiates_bf16():
    # The step does not compile: XLA's CPU compiler aborts on a CHECK, and tracing it for GPUs
    # fails an assertion in the backward of cuDNN attention's cond (docs/parallelism.md)
    raise ValueError(f'config.mesh.stage={run.mesh.stage} with the trained parameters in bfloat16 '
                     "(config.model.param_dtype, or master_tier off the devices, whose copy is in "
                     "compute_dtype) does not compile yet; keep param_dtype='float32' and "
                     "config.optimizer.master_tier='device' under pipeline stages")
  if model.qk_clip:
    check_qk_clip(run)
  hierarchical.check_partition(run.partition, run.mesh, model)
  tokens.check_settings(run.data)
  if run.data.preference:
    check_preference(run)
  if run.optimizer.tiered:
    check_tiers(run)


def check_qk_clip(run: Run) -> None:
  """What QK-clip (config.model.qk_clip) does not run with yet, said before anything starts (the
  optimizer tiers: check_tiers): it reads each layer's measure in the step that updates the
  weights."""
  why = ('config.mesh.stage > 1 (pipeline stages)' if run.mesh.stage != 1
         else 'config.mesh.sequence > 1 (a split length)' if run.mesh.sequence != 1
         else "config.data.record='preference' (DPO)" if run.data.preference else None)
  if why:
    raise ValueError(f'config.model.qk_clip={run.model.qk_clip} does not run with {why} yet; '
                     'set qk_clip=0 or change that setting')
  if run.model.qk_clip <= math.log(run.seq_len):  # a row of equal logits measures ln(its keys)
    raise ValueError(f"config.model.qk_clip={run.model.qk_clip}: QK-clip's measure, a head's "
                     'largest log-sum-exp, reaches ln(keys seen) even with every logit 0, so a '
                     f'clip at or below ln(config.seq_len) = {math.log(run.seq_len):.2f} would '
                     'shrink the query and key weights step after step; set qk_clip above '
                     'ln(config.seq_len) (Kimi K2: 100)')


def check_tiers(run: Run) -> None:
  """What the optimizer state's tiers (training/tiers.py) do not run with yet, said before
  anything starts."""
  if why := run.untiered_because():
    raise ValueError(f"{why}, which the optimizer state's tiers (config.optimizer.master_tier, "
                     "mu_tier, nu_tier) do not run with yet; set them to 'device'")


def check_preference(run: Run) -> None:
  """What DPO (config.data.record='preference') does not run with yet, said before anything
  starts."""
  if run.model.draft_heads:
    raise ValueError("config.data.record='preference' (DPO) trains the model on pairs, where draft "
                     'heads have no next tokens to learn; set config.model.draft_heads=0')
  if run.data.train_on != 'answers':
    raise ValueError(f"config.data.train_on={run.data.train_on!r}: DPO compares the answers of a "
                     "pair (config.data.record='preference'), never the prompt; set "
                     "config.data.train_on=answers")


def check_start(run: Run) -> None:
  """What training alone needs (a plan needs neither): a workdir of its own, and a run that trains
  on a frozen base (LoRA, draft heads alone) starts from a model, or says it means a random one.
  ValueError otherwise."""
  if not run.workdir.strip():
    raise ValueError(workdir_lib.EMPTY)
  model = run.model
  if (model.lora_rank or model.draft_only) and not run.init_from:
    what = ('config.model.draft_only=True trains draft heads on a frozen model' if
            model.draft_only else f'config.model.lora_rank={model.lora_rank} trains adapters on '
            'a frozen base')
    raise ValueError(f'{what}, and config.init_from is empty: it would be random weights. Start '
                     "from a model (--config.init_from=hf:DIR, or a run's workdir), or set "
                     f'--config.init_from={RANDOM} to mean it')
