"""The fault probe: the ways a user or their machine can make meshlm fail that we know of, each run
as a user would, with real files, processes and signals, and judged:

  GOOD  the run did what it should: an expected failure is one `error:` line naming the file or
        setting, exit status 2, and nothing written; a run that should survive survives exactly
  UGLY  the right outcome, but buried: a traceback, more than one line, another exit status
  BAD   work lost or corrupted, or a mistake accepted

  python scripts/fault_probe.py            # every case (18 minutes on 2 cores)
  python scripts/fault_probe.py --only=sample

On the CPU with 8 simulated devices: base.py's small model on the standard library's json and
email packages. Prints a table and ends with one JSON line of the counts.
"""

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
STDLIB = sysconfig.get_paths()['stdlib']
CORPUS = f'{STDLIB}/json/*.py,{STDLIB}/email/*.py'
HF = REPO / 'tests' / 'data' / 'hf-llama-untied'
# Each case's runs take a few steps, so a program compiled without LLVM's optimisations (in about
# half the time, running slower) costs less in all, as in the test process (tests/conftest.py).
FAST_COMPILE = '--xla_backend_optimization_level=0'


class Probe:
  """Where the cases run: a scratch directory, its TFDS data dir and compilation cache, and a
  trained run (6 steps, checkpoints at 3 and 6) each case may copy."""

  def __init__(self, root: pathlib.Path):
    self.root, self.count = root, 0
    self.env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1',
                'XLA_FLAGS': f'--xla_force_host_platform_device_count=8 {FAST_COMPILE}',
                'TFDS_DATA_DIR': str(root / 'tfds'),
                'JAX_COMPILATION_CACHE_DIR': str(root / 'xla-cache'),
                'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'}
    self._template = None

  @property
  def template(self) -> pathlib.Path:
    """The trained run, trained when a case first needs it."""
    if self._template is None:
      self._template = self.root / 'trained'
      result = self.run(*self.train(self._template, steps=6))
      assert result.returncode == 0, result.stderr[-3000:]
    return self._template

  def path(self, name: str) -> pathlib.Path:
    self.count += 1
    return self.root / f'{self.count:02d}-{name}'

  def trained(self) -> pathlib.Path:
    """A copy of the trained run."""
    copy = self.path('run')
    shutil.copytree(self.template, copy)
    return copy

  @staticmethod
  def train(workdir, steps=6, *more):
    return ('train.py', '--config=configs/base.py', f'--config.workdir={workdir}',
            f'--config.train_steps={steps}', '--config.checkpoint_every=3', '--config.log_every=1',
            '--config.eval_every=3', '--config.eval_batches=1', f'--config.data.paths={CORPUS}',
            '--config.data.validation_fraction=0.1', *more)

  def command(self, args, file_size_limit=None):
    command = [sys.executable, *args]
    if file_size_limit:  # writes past it fail with EFBIG, as a full disk's with ENOSPC
      command = [sys.executable, '-c', 'import os, resource, signal, sys\n'
                 'signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
                 f'resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit},) * 2)\n'
                 'os.execv(sys.executable, [sys.executable, *sys.argv[1:]])', *args]
    return command

  def run(self, *args, file_size_limit=None, cwd=REPO, devices=8):
    env = {**self.env,
           'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices} {FAST_COMPILE}'}
    return subprocess.run(self.command(args, file_size_limit), cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=900)

  def start(self, *args):
    # Ctrl-C as at a terminal: a probe started in the background (a shell's `&`, a test worker)
    # would hand its processes SIGINT ignored, which Python then never turns into
    # KeyboardInterrupt.
    return subprocess.Popen(self.command(args), cwd=REPO, env=self.env, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.strip()]


def refused(result, expected: str, untouched=()) -> tuple[str, str]:
  """An expected failure: one `error:` line containing `expected`, exit 2, `untouched` paths
  not created."""
  err = lines(result.stderr)
  if result.returncode == 0:
    return 'BAD', 'accepted (exit 0)'
  if created := [str(p) for p in untouched if pathlib.Path(p).exists()]:
    return 'BAD', f'wrote {created}'
  if result.returncode != 2 or 'Traceback' in result.stderr or len(err) != 1:
    return 'UGLY', f'exit {result.returncode}, {len(err)} lines: {err[-1][:120] if err else ""}'
  if not err[0].startswith('error: ') or expected not in err[0]:
    return 'UGLY', f'another message: {err[0][:160]}'
  return 'GOOD', err[0][:160]


def survived(result, must=()) -> tuple[str, str]:
  if result.returncode != 0:
    return 'BAD', f'exit {result.returncode}: {lines(result.stderr)[-1:]}'
  if 'Traceback' in result.stderr:
    return 'UGLY', 'exit 0 with a traceback'
  missing = [m for m in must if m not in result.stdout + result.stderr]
  return ('GOOD', 'exit 0') if not missing else ('BAD', f'never said {missing}')


def metrics(workdir) -> list[dict]:
  return [json.loads(line) for line in (pathlib.Path(workdir) / 'metrics.jsonl').open()]


def steps_once(workdir, n: int) -> bool:
  logged = [r['step'] for r in metrics(workdir) if 'loss' in r]
  return logged == list(range(1, n + 1))


def resumed(result, expected: list[str], workdir, n: int):
  """A resumed run's verdict: `survived` with `expected`, and steps 1..n each logged once."""
  verdict = survived(result, expected)
  return verdict if steps_once(workdir, n) else ('BAD', 'steps logged twice or missing')


def as_uninterrupted(p, verdict, workdir, n: int = 12):
  """`verdict`, if GOOD only when `workdir`, stopped and resumed, trained as the same command
  uninterrupted does (trained once, the cases' reference), bit for bit: every step's loss,
  gradient norm and learning rate, and the checksums of every array of the final state."""
  if verdict[0] != 'GOOD':
    return verdict
  reference = p.root / f'uninterrupted-{n}'
  if not reference.exists():
    result = p.run(*p.train(reference, n))
    assert result.returncode == 0, result.stderr[-3000:]

  def trained(run):
    steps = {r['step']: (r['loss'], r['grad_norm'], r['learning_rate'])
             for r in metrics(run) if 'loss' in r}
    return steps, json.loads((run / 'checkpoints' / str(n) / 'checksums' / 'metadata').read_text())

  (ours, our_state), (theirs, their_state) = trained(workdir), trained(reference)
  if differ := [step for step in theirs if ours.get(step) != theirs[step]]:
    return 'BAD', f'steps {differ} trained otherwise than uninterrupted'
  if our_state != their_state:
    return 'BAD', f'the state at step {n} differs from the uninterrupted run\'s'
  return verdict[0], f'{verdict[1]}, as uninterrupted bit for bit'


def read_until(process, prefix: str) -> str:
  for line in process.stdout:
    if line.startswith(prefix):
      return line
  return ''


def array_files(checkpoint: pathlib.Path) -> list[pathlib.Path]:
  return [f for f in (checkpoint / 'state').rglob('*') if f.is_file() and '/d/' in str(f)]


# Each case: (name, function of the probe) → (verdict, what was seen).
CASES = {}


def case(name):
  def register(fn):
    CASES[name] = fn
    return fn
  return register


def config_file(p, name, text):
  path = p.path(name).with_suffix('.py')
  path.write_text(text)
  return path


BASE = 'from configs import base\n\n\ndef get_config():\n  c = base.get_config()\n'

SETTINGS = {  # name: (arguments after train.py's, what the line must say)
    'flag typo': (['--config.train_step=5'], "no setting 'train_step'; did you mean train_steps"),
    'nested flag typo': (['--config.model.n_layer=3'], 'did you mean n_layers'),
    'unknown preset': (['--config=configs/llama.py:3b'], "unknown preset '3b'"),
    'mesh that does not divide': (['--config.mesh.data=3'], 'config.mesh'),
    'expert axis on a dense model': (['--config.mesh.expert=2'], 'config.mesh.expert=2'),
    'int8 gathers without hierarchy': (['--config.partition.weights=int8'],
                                       'config.partition.hierarchical=True'),
    'unknown TFDS dataset': (['--config.data.name=no_such'], 'config.data.name'),
    'learning rate NaN': (['--config.optimizer.learning_rate=nan'], 'learning_rate=nan'),
    'learning rate inf': (['--config.optimizer.learning_rate=inf'], 'learning_rate=inf'),
    'learning rate negative': (['--config.optimizer.learning_rate=-1'], 'learning_rate=-1'),
    'z-loss NaN': (['--config.loss.z_loss=nan'], 'config.loss.z_loss=nan'),
    'z-loss inf': (['--config.loss.z_loss=inf'], 'config.loss.z_loss=inf is not a number a run '
                   'can use'),
    'hf: a model setting its config.json contradicts': (
        ['--config.model.d_model=128', f'--config.init_from=hf:{HF}'],
        'config.model.d_model=128, but config.init_from=hf:'),
    'warmup negative': (['--config.optimizer.warmup_steps=-3'], 'warmup_steps=-3'),
    'seq_len 0': (['--config.seq_len=0'], 'config.seq_len=0'),
    'batch not divisible': (['--config.batch_size=6'], 'config.batch_size=6'),
    'bad data paths': (['--config.data.paths=/nonexistent/*.txt'], 'config.data.paths'),
    'tokenize typo': (['--config.data.tokenize=twice'], 'config.data.tokenize'),
    'data workers that do not divide the rows': (['--config.data.workers=3'],
                                                 'config.data.workers=3'),
    'init_from nothing': (['--config.init_from=/nonexistent'], 'config.init_from'),
    'init_adapters misspelt': (['--config.init_adapters=merged'],
                               "config.init_adapters='merged' is not one of merge, leave"),
    'hf: without config.json': (['--config.init_from=hf:/nonexistent'], 'holds no config.json'),
    'sliding windows of local and global layers on cuDNN': (
        ['--config.model.sliding_window=8', '--config.model.global_every=2',
         '--config.model.attention=cudnn'], 'each layer takes its window at run time'),
    'muon with the optimizer state in host memory': (
        ['--config.optimizer.name=muon', '--config.optimizer.mu_tier=host'],
        "config.optimizer.name='muon' updates each matrix whole inside the step"),
    'muon layout misspelt': (['--config.optimizer.name=muon',
                              '--config.optimizer.muon_layout=gathered'],
                             "config.optimizer.muon_layout='gathered'"),
    'qk_clip with q/k norms': (['--config.model.qk_clip=50', '--config.model.qk_norm=True'],
                               'the norms undo any scale of the query and key weights'),
    'qk_clip on cuDNN': (['--config.model.qk_clip=50', '--config.model.attention=cudnn'],
                         'its path gives no log-sum-exp yet'),
    'qk_clip over pipeline stages': (['--config.model.qk_clip=50', '--config.mesh.stage=2'],
                                     'does not run with config.mesh.stage > 1'),
    'qk_clip with the optimizer state in host memory': (
        ['--config.model.qk_clip=50', '--config.optimizer.mu_tier=host'],
        'config.model.qk_clip=50.0 scales weights inside the step'),
    'qk_clip below what a uniform row reaches': (['--config.model.qk_clip=2'],
                                                 'set qk_clip above ln(config.seq_len)'),
    'wsd decay shape misspelt': (['--config.optimizer.schedule=wsd',
                                  '--config.optimizer.decay_shape=cosine'],
                                 "config.optimizer.decay_shape='cosine'"),
    'extra argument': (['oops'], 'unexpected arguments'),
    'LoRA target typo': (['--config.model.lora_rank=4', '--config.model.lora_targets=q,x'],
                         "config.model.lora_targets='q,x'"),
    'chat template file missing': (['--config.data.chat_template=/nonexistent.jinja'],
                                   'config.data.chat_template'),
    'draft heads alone, none asked': (['--config.model.draft_only=True'],
                                      'config.model.draft_heads'),
    'attention kept with no kernel to keep': (['--config.model.attention=xla',
                                               '--config.model.remat_policy=dots_attention'],
                                              "remat_policy='dots_attention'"),
    'attention kept, out projection redone, no kernel': (
        ['--config.model.attention=xla', '--config.model.remat_policy=dots_attention_except_out'],
        "remat_policy='dots_except_out'"),
    'hopper attention at a head dim it lacks': (['--config.model.attention=hopper'],
                                                "config.model.attention='hopper' cannot run "
                                                'head_dim=16'),
    'hopper attention in float32': (['--config.model.attention=hopper', '--config.model.head_dim=64',
                                     '--config.model.compute_dtype=float32'],
                                    "cannot run compute_dtype='float32'"),
    'hopper attention over part blocks': (['--config.model.attention=hopper',
                                           '--config.model.head_dim=64', '--config.seq_len=100'],
                                          'takes whole blocks of 128 positions'),
    'hopper attention with a key block past the rows': (
        ['--config.dry_run=True', '--config.plan.target=H100', '--config.model.attention=hopper',
         '--config.model.head_dim=64', '--config.model.attention_block_k=256'],
        'config.model.attention_block_k=256; it masks no padding), and config.seq_len=128 gives '
        'each call 128: set --config.model.attention_block_k=128'),
    'hopper attention in blocks of 32 rows': (['--config.model.attention=hopper',
                                               '--config.model.head_dim=64',
                                               '--config.model.attention_block_q=32'],
                                              'takes attention_block_q 0 or 64'),
    'hopper attention trained on a CPU': (['--config.model.attention=hopper',
                                           '--config.model.head_dim=64'],
                                          "config.model.attention='hopper' needs a Hopper GPU"),
    'hopper attention planned for an A100': (['--config.dry_run=True', '--config.plan.target=A100',
                                              '--config.model.attention=hopper',
                                              '--config.model.head_dim=64'],
                                             "config.model.attention='hopper' needs a Hopper GPU"),
    'remat policy misspelt': (['--config.model.remat_policy=dots_except'],
                              'config.model.remat_policy'),
    'cudnn segments negative': (['--config.model.cudnn_segments=-1'],
                                'config.model.cudnn_segments=-1'),
    'weight prefetch not a yes or no': (['--config.model.prefetch_weights=sometimes'],
                                        'config.model.prefetch_weights=sometimes'),
    'XLA scheduler given a share past any memory': (['--config.model.scheduler_memory=15'],
                                                    'config.model.scheduler_memory=15'),
    'offloaded state planned for a GPU here': (['--config.dry_run=True', '--config.plan.target=H100',
                                                '--config.optimizer.offload_state=True'],
                                               'the deviceless compiler has no host memory'),
    'bf16 gradients under fp32 compute': (['--config.model.compute_dtype=float32',
                                           '--config.model.grad_reduce_dtype=bfloat16'],
                                          "config.model.grad_reduce_dtype='bfloat16' with "
                                          "compute_dtype='float32'"),
    'lm-eval task during training it does not know': (['--config.lm_eval.tasks=hellaswagg'],
                                                      'config.lm_eval.tasks: no lm-eval task '
                                                      'named hellaswagg'),
    'lm-eval task misspelt in a dry run': (['--config.dry_run=True',
                                            '--config.lm_eval.tasks=stdlib_nextline'],
                                           'config.lm_eval.tasks: no lm-eval task named '
                                           'stdlib_nextline'),
    'lm-eval task directory missing': (['--config.lm_eval.tasks=stdlib_next_line',
                                        '--config.lm_eval.include_path=/nonexistent/tasks'],
                                       'config.lm_eval.include_path: /nonexistent/tasks is not a '
                                       'directory'),
    'lm-eval interval negative': (['--config.lm_eval.every=-5'], 'config.lm_eval.every=-5'),
    'DPO beta 0': (['--config.data.record=preference', '--config.dpo.beta=0'],
                   'config.dpo.beta=0'),
    'DPO label smoothing 0.5': (['--config.data.record=preference',
                                 '--config.dpo.label_smoothing=0.5'],
                                'config.dpo.label_smoothing=0.5'),
    'DPO on every token': (['--config.data.record=preference', '--config.data.train_on=all'],
                           "config.data.train_on='all': DPO compares the answers"),
    'state tier misspelt': (['--config.optimizer.mu_tier=disk'],
                            "config.optimizer.mu_tier='disk' is not a tier"),
    'NVMe tier in a relative directory': (['--config.optimizer.nu_tier=nvme:state'],
                                          'give the NVMe directory as an absolute path'),
    'state tiers beside offload_state': (['--config.optimizer.offload_state=True',
                                          '--config.optimizer.mu_tier=host'],
                                         'config.optimizer.offload_state=True keeps the moments'),
    'state tiers under LoRA': (['--config.model.lora_rank=4', '--config.init_from=random',
                                '--config.optimizer.mu_tier=host'],
                               'lora_rank=4 trains adapters small enough for the devices'),
    "host tier past the host's memory": (['--config=configs/llama.py:70b',
                                          '--config.optimizer.mu_tier=host',
                                          '--config.optimizer.nu_tier=host'],
                                         'the host tier holds 525.67 GiB of the state'),
    'bf16 trained parameters under pipeline stages': (
        ['--config.mesh.stage=2', '--config.mesh.fsdp=4', '--config.microbatches=2',
         '--config.optimizer.master_tier=host'],
        'config.mesh.stage=2 with the trained parameters in bfloat16'),
    'no layout fits the memory': (['--config.mesh.auto=True', '--config.plan.memory_gb=1e-9'],
                                  'fits, even with the optimizer state in host memory'),
    'a step that does not fit the memory': (['--config.plan.memory_gb=1e-6'],
                                            'per device (arguments'),
}


def settings_case(args, expected):
  def probe(p):
    workdir = p.path('refused')
    script, *train = p.train(workdir)
    more = args
    if args[0].startswith('--config='):  # a config of its own, named first as train.py wants
      train = [args[0], *(a for a in train if not a.startswith('--config='))]
      more = args[1:]
    return refused(p.run(script, *train, *more), expected, [workdir])
  return probe


for _name, (_args, _expected) in SETTINGS.items():
  CASES[f'setting: {_name}'] = settings_case(_args, _expected)


@case('config: missing file')
def _(p):
  return refused(p.run('train.py', '--config=configs/nope.py'), 'no such config file')


@case('config: missing file and an override')
def _(p):
  return refused(p.run('train.py', '--config=configs/nope.py', '--config.train_steps=3'),
                 'no such config file')


CONFIG_FILES = {  # name: (the file's text, what the line must say)
    'does not parse': ('def get_config(:\n', 'does not parse'),
    'no get_config': ('x = 1\n', 'has no get_config()'),
    'raises at import': ('raise RuntimeError("no quota")\n',
                         'raises RuntimeError: no quota (line 1'),
    'get_config raises': ('def get_config():\n  return {}["nope"]\n',
                          "raises KeyError: 'nope' (line 2"),
    'typo inside the file': (BASE + '  c.modle.d_model = 3\n  return c\n', "'modle'"),
}


def config_file_case(text, expected):
  def probe(p):
    return refused(p.run('train.py', f'--config={config_file(p, "config", text)}'), expected)
  return probe


for _name, (_text, _expected) in CONFIG_FILES.items():
  CASES[f'config: {_name}'] = config_file_case(_text, _expected)


@case('config: a field meshlm lacks')
def _(p):
  workdir = p.path('refused')
  path = config_file(p, 'field', BASE + '  c.optimizer.lr = 1e-3\n  return c\n')
  train = [f'--config={path}' if a.startswith('--config=') else a for a in p.train(workdir)]
  return refused(p.run(*train), 'config.optimizer.lr is not a setting', [workdir])


@case('workdir: empty')
def _(p):
  here = p.path('here')
  here.mkdir()
  result = p.run(*[str(REPO / a) if a == 'train.py' else a.replace('configs/', f'{REPO}/configs/')
                   for a in p.train('')], cwd=here)
  return refused(result, 'config.workdir is empty') if not list(here.iterdir()) else (
      'BAD', f'wrote {list(here.iterdir())}')


@case('workdir: a file')
def _(p):
  file = p.path('file')
  file.write_text('mine')
  verdict = refused(p.run(*p.train(file)), 'config.workdir')
  return verdict if file.read_text() == 'mine' else ('BAD', 'the file was changed')


@case('workdir: held by a live run')
def _(p):
  workdir = p.path('held')
  first = p.start(*p.train(workdir, 400))
  read_until(first, 'step ')
  second = p.run(*p.train(workdir, 400))
  first.send_signal(signal.SIGKILL)
  first.wait()
  return refused(second, 'is in use by another run')


@case('hf: truncated safetensors')
def _(p):
  hf = p.path('hf')
  shutil.copytree(HF, hf)
  weights = (hf / 'model.safetensors').read_bytes()
  (hf / 'model.safetensors').write_bytes(weights[:len(weights) // 2])
  workdir = p.path('refused')
  return refused(p.run(*p.train(workdir), f'--config.init_from=hf:{hf}'),
                 'model.safetensors does not read', [workdir])


@case('hf: config.json not JSON')
def _(p):
  hf = p.path('hf')
  shutil.copytree(HF, hf)
  (hf / 'config.json').write_text('{"vocab_size": ')
  return refused(p.run(*p.train(p.path('x')), f'--config.init_from=hf:{hf}'), 'is not JSON')


@case('hf: a Gemma 3 with logit softcapping')
def _(p):
  hf = p.path('hf')
  shutil.copytree(REPO / 'tests' / 'data' / 'hf-gemma3', hf)
  config = json.loads((hf / 'config.json').read_text())
  (hf / 'config.json').write_text(json.dumps({**config, 'final_logit_softcapping': 30.0}))
  return refused(p.run(*p.train(p.path('x')), f'--config.init_from=hf:{hf}'),
                 'final_logit_softcapping=30.0')


@case('hf: weights of another shape')
def _(p):
  hf = p.path('hf')
  shutil.copytree(HF, hf)
  config = json.loads((hf / 'config.json').read_text())
  (hf / 'config.json').write_text(json.dumps({**config, 'intermediate_size': 96}))
  return refused(p.run(*p.train(p.path('x')), f'--config.init_from=hf:{hf}'), 'not [64, 96]')


@case('resume: changed seed')
def _(p):
  run = p.trained()
  return refused(p.run(*p.train(run, 9), '--config.seed=5'), 'config.seed=5')


@case('resume: another model')
def _(p):
  run = p.trained()
  before = (run / 'metrics.jsonl').read_text()
  verdict = refused(p.run(*p.train(run, 9), '--config.model.d_model=32'),
                    'config.model.d_model=32, but checkpoint')
  return verdict if (run / 'metrics.jsonl').read_text() == before else ('BAD', 'metrics changed')


@case('resume: another mesh')
def _(p):
  run = p.trained()
  result = p.run(*p.train(run, 9), '--config.mesh.fsdp=4', '--config.mesh.tensor=2')
  return resumed(result, ['resuming from step 6'], run, 9)


@case('resume: stages and fp8')
def _(p):
  run = p.trained()
  result = p.run(*p.train(run, 9), '--config.mesh.stage=2', '--config.microbatches=4',
                 '--config.model.matmul_precision=fp8')
  return resumed(result, ['resuming from step 6'], run, 9)


MOE = ('--config.model.experts=4', '--config.model.expert_matmul=ragged_dot')
# An MoE that drops tokens, in fp32 so that identical prompts sample identically; its cases share
# one trained run (ragged_dot: Pallas's interpreter would only slow them).
MOE_DROPS = (*MOE, '--config.model.capacity_factor=1.0', '--config.model.compute_dtype=float32')


@case('resume: an MoE that drops tokens, with other microbatches')
def _(p):
  run = trained_with(p, 'moe-drops', *MOE_DROPS)
  result = p.run(*p.train(run, 9), *MOE_DROPS, '--config.microbatches=2')
  verdict = refused(result, "config.microbatches=2, but checkpoint")
  # The why: with a capacity, which tokens drop depends on the microbatches (configs/base.py).
  return verdict if verdict[0] != 'GOOD' or "the run's MoE drops" in result.stderr else (
      'UGLY', 'the refusal does not say why: the MoE drops tokens')


@case('resume: an MoE that drops tokens, on fewer devices')
def _(p):
  run = trained_with(p, 'moe-drops', *MOE_DROPS)
  return refused(p.run(*p.train(run, 9), *MOE_DROPS, devices=4),
                 'config.mesh.fsdp=4, but checkpoint')


@case('resume: a dropless MoE, with other microbatches')
def _(p):
  run = trained_with(p, 'moe', *MOE)
  return resumed(p.run(*p.train(run, 9), *MOE, '--config.microbatches=2'),
                 ['resuming from step 6'], run, 9)


@case('resume: a changed learning rate is named')
def _(p):
  run = p.trained()
  return resumed(p.run(*p.train(run, 9), '--config.optimizer.learning_rate=0.001'),
                 ['config.optimizer.learning_rate 0.003 → 0.001'], run, 9)


def stopped_and_resumed(p, signum, at='step  4/'):
  workdir = p.path('signal')
  process = p.start(*p.train(workdir, 12))
  read_until(process, at)
  process.send_signal(signum)
  out, _ = process.communicate(timeout=300)
  if process.returncode != 0 or not (stopped := re.search(r'stopped by \w+ after step (\d+)', out)):
    return 'BAD', f'exit {process.returncode} without saving'
  # Resumed from the step the signal's save holds, wherever the signal found the run.
  return as_uninterrupted(p, resumed(p.run(*p.train(workdir, 12)),
                                     [f'resuming from step {stopped[1]}'], workdir, 12), workdir)


@case('signal: SIGTERM mid-run, then resume')
def _(p):
  return stopped_and_resumed(p, signal.SIGTERM)


@case('signal: SIGINT mid-run, then resume')
def _(p):
  return stopped_and_resumed(p, signal.SIGINT)


@case('signal: SIGTERM at the last step, its evaluations due, then rerun')
def _(p):
  """The stop lands while step 5's tasks are scored, so the last step, 6, saves and stops with
  its validation pass and scoring due: the rerun computes both, once, then says it is finished."""
  workdir = p.path('signal')
  args = (*p.train(workdir, 6), '--config.lm_eval.tasks=stdlib_next_line',
          '--config.lm_eval.every=5', '--config.lm_eval.limit=8')
  process = p.start(*args)
  read_until(process, 'step 5/6 | loss')  # LogMetrics': step 5's scoring comes after it
  process.send_signal(signal.SIGTERM)
  out, _ = process.communicate(timeout=300)
  if process.returncode != 0 or 'stopped by SIGTERM after step 6' not in out:
    return 'BAD', f'exit {process.returncode}: {lines(out)[-1:]}'
  for attempt in range(2):  # the second finds both done
    if (verdict := survived(p.run(*args), ['is finished']))[0] != 'GOOD':
      return verdict
  at_6 = [r for r in metrics(workdir) if r['step'] == 6]
  kinds = sorted('train' if 'loss' in r else 'eval' if 'eval_loss' in r else
                 'tasks' if 'lm_eval_time_s' in r else str(r) for r in at_6)
  if kinds != ['eval', 'tasks', 'train'] or not steps_once(workdir, 6):
    return 'BAD', f'step 6 logged {kinds}'
  return 'GOOD', 'the rerun evaluated and scored step 6 once, then finished'


@case('signal: SIGTERM while compiling')
def _(p):
  """The step compiles before the run writes anything, and SIGTERM then ends it at once with one
  line, exit 143 (runtime/cli.py; one that lands once the steps have begun stops it as mid-run);
  either way the same command then trains every step once."""
  workdir = p.path('signal')
  process = p.start(*p.train(workdir, 12))
  read_until(process, 'meshlm: ')  # printed just before the compile
  process.send_signal(signal.SIGTERM)
  out, _ = process.communicate(timeout=300)
  if process.returncode == 0 and 'stopped by' in out:
    return resumed(p.run(*p.train(workdir, 12)), ['resuming from step'], workdir, 12)
  if process.returncode != 128 + signal.SIGTERM or 'train.py: stopped by SIGTERM' not in out:
    return 'BAD', f'exit {process.returncode}: {lines(out)[-1:]}'
  if (workdir / 'checkpoints').exists() and any((workdir / 'checkpoints').iterdir()):
    return 'BAD', 'killed with a checkpoint begun'
  return as_uninterrupted(p, resumed(p.run(*p.train(workdir, 12)), ['step 12/12'], workdir, 12),
                          workdir)


@case('signal: SIGKILL mid-run, then resume')
def _(p):
  workdir = p.path('killed')
  process = p.start(*p.train(workdir, 12))
  read_until(process, 'step  5/')
  process.send_signal(signal.SIGKILL)
  process.wait()
  return as_uninterrupted(p, resumed(p.run(*p.train(workdir, 12)), ['resuming from step 3'],
                                     workdir, 12), workdir)


def on_nvme(directory) -> list[str]:
  return [f'--config.optimizer.{name}=nvme:{directory}'
          for name in ('master_tier', 'mu_tier', 'nu_tier')]


@case('tiers: the NVMe directory under a file')
def _(p):
  file = p.path('file')
  file.write_text('mine')
  workdir = p.path('refused')
  verdict = refused(p.run(*p.train(workdir), *on_nvme(file / 'state')), 'cannot be written here',
                    [workdir])
  return verdict if file.read_text() == 'mine' else ('BAD', 'the file was changed')


@case('tiers: a disk that refuses the NVMe files')
def _(p):
  nvme = p.path('nvme')
  nvme.mkdir()
  # Once whole, so that the corpus is prepared and the step in the compilation cache: then the
  # tier's files are the first large ones the limited run writes.
  first = survived(p.run(*p.train(p.path('whole')), *on_nvme(nvme)))
  if first[0] != 'GOOD':
    return first
  verdict = refused(p.run(*p.train(p.path('run')), *on_nvme(nvme), file_size_limit=50_000),
                    "config.optimizer.master_tier: writing the NVMe tier's")
  return verdict if not list(nvme.iterdir()) else ('BAD', f'left {list(nvme.rglob("*"))}')


def tiered_at_step_5(p, name: str):
  """(workdir, NVMe directory, process): a 12-step run with its state on NVMe, at step 5."""
  workdir, nvme = p.path(name), p.path('nvme')
  nvme.mkdir()
  process = p.start(*p.train(workdir, 12), *on_nvme(nvme))
  read_until(process, 'step  5/')
  return workdir, nvme, process


@case('tiers: SIGKILL mid-run with the state on NVMe, then resume')
def _(p):
  workdir, nvme, process = tiered_at_step_5(p, 'killed')
  process.send_signal(signal.SIGKILL)
  process.wait()
  verdict = resumed(p.run(*p.train(workdir, 12), *on_nvme(nvme)), ['resuming from step 3'],
                    workdir, 12)
  return verdict if not list(nvme.iterdir()) else ('BAD', f'left {list(nvme.rglob("*"))}')


@case('tiers: a state file on NVMe damaged mid-run, then resume')
def _(p):
  workdir, nvme, process = tiered_at_step_5(p, 'damaged')
  process.send_signal(signal.SIGSTOP)  # a bit of each of Adam's second moment's files flipped
  for victim in nvme.glob('meshlm-*/process-0/nu/*.bin'):
    with open(victim, 'r+b') as f:
      f.seek(victim.stat().st_size // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0x10]))
  process.send_signal(signal.SIGCONT)
  out, _ = process.communicate(timeout=300)
  said = lines(out)[-1:]
  if process.returncode != 2 or 'Traceback' in out:
    return 'BAD' if process.returncode == 0 else 'UGLY', f'exit {process.returncode}: {said}'
  if not said or not said[0].startswith('error: config.optimizer.nu_tier: ') or (
      'changed on disk' not in said[0]):
    return 'UGLY', f'said {said}'
  if list(nvme.iterdir()):
    return 'BAD', f'left {list(nvme.rglob("*"))}'
  return resumed(p.run(*p.train(workdir, 12), *on_nvme(nvme)), ['resuming from step'], workdir, 12)


@case("tiers: a checkpoint's pieces damaged on disk, then resume")
def _(p):
  workdir, nvme = p.path('pieces'), p.path('nvme')
  nvme.mkdir()
  first = survived(p.run(*p.train(workdir, 6), *on_nvme(nvme)))
  if first[0] != 'GOOD':
    return first
  # a bit of the largest file of the newest checkpoint's state that a tier held
  chunks = [f for f in (workdir / 'checkpoints' / '6' / 'pieces').rglob('*') if f.is_file()
            and f.suffix != '.json' and f.name != 'zarr.json']
  if not chunks:
    return 'BAD', 'checkpoint 6 holds no pieces'
  victim = max(chunks, key=lambda f: f.stat().st_size)
  with open(victim, 'r+b') as f:
    f.seek(victim.stat().st_size // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))
  verdict = resumed(p.run(*p.train(workdir, 9), *on_nvme(nvme)),
                    ['differ from their checksums', 'resuming from step 3'], workdir, 9)
  if verdict[0] == 'GOOD' and not (workdir / 'checkpoints-damaged' / '6').is_dir():
    return 'BAD', 'the damaged checkpoint was not set aside'
  return verdict if not list(nvme.iterdir()) else ('BAD', f'left {list(nvme.rglob("*"))}')


@case('signal: SIGINT on an evaluation step')
def _(p):
  workdir = p.path('eval')
  every = ['--config.eval_every=1']
  process = p.start(*p.train(workdir, 12), *every)
  read_until(process, 'step  5/')
  process.send_signal(signal.SIGINT)
  process.communicate(timeout=300)
  verdict = survived(p.run(*p.train(workdir, 12), *every), ['resuming from step'])
  evaluated = sorted(r['step'] for r in metrics(workdir) if 'eval_loss' in r)
  if evaluated != list(range(1, 13)):
    return 'BAD', f'evaluated {evaluated}'
  return verdict if steps_once(workdir, 12) else ('BAD', 'steps logged twice or missing')


@case('signal: a second SIGINT mid-run, then resume')
def _(p):
  workdir = p.path('twice')
  process = p.start(*p.train(workdir, 12))
  read_until(process, 'step  5/')
  process.send_signal(signal.SIGINT)
  read_until(process, 'meshlm: SIGINT received')
  process.send_signal(signal.SIGINT)
  out, _ = process.communicate(timeout=300)
  if process.returncode != -signal.SIGINT:
    return 'BAD', f'exit {process.returncode}: {lines(out)[-3:]}'
  if lines(out)[-1:] != ['train.py: stopped by SIGINT'] or 'Traceback' in out:
    return 'UGLY', f'said {lines(out)[-3:]}'
  return as_uninterrupted(p, resumed(p.run(*p.train(workdir, 12)), ['resuming from step'],
                                     workdir, 12), workdir)


def sample_stopped(p, signum, returncode: int):
  """sample.py mid-generation, sent `signum`: it ends with `returncode` and says so in one line,
  no traceback."""
  process = p.start('sample.py', f'--workdir={p.template}', '--max_len=2048',
                    '--max_new_tokens=2000')
  read_until(process, '# ')
  process.send_signal(signum)
  out, _ = process.communicate(timeout=300)
  if process.returncode != returncode:
    return 'UGLY', f'exit {process.returncode}'
  said = f'sample.py: stopped by {signal.Signals(signum).name}'
  return ('GOOD', said) if lines(out)[-1:] == [said] and 'Traceback' not in out else (
      'UGLY', f'said {lines(out)[-2:]}')


@case('signal: sample.py SIGINT')
def _(p):
  return sample_stopped(p, signal.SIGINT, -signal.SIGINT)


@case('signal: sample.py SIGTERM')
def _(p):
  return sample_stopped(p, signal.SIGTERM, 128 + signal.SIGTERM)


def damage(checkpoint: pathlib.Path, how: str) -> None:
  for f in array_files(checkpoint):
    data = bytearray(f.read_bytes())
    if how == 'truncate':
      data = data[:len(data) // 3]
    elif len(data) > 100_000:  # bytes changed inside array chunks (not the index's nodes):
      for at in range(4096, len(data) - 64, 8192):  # orbax restores them without complaint
        data[at:at + 64] = os.urandom(64)
    f.write_bytes(bytes(data))


@case('checkpoint: newest truncated')
def _(p):
  run = p.trained()
  damage(run / 'checkpoints' / '6', 'truncate')
  verdict = survived(p.run(*p.train(run, 9)), ['resuming from step 3'])
  kept = (run / 'checkpoints-damaged' / '6').is_dir()
  return verdict if kept and steps_once(run, 9) else ('BAD', 'not set aside, or steps twice')


@case('checkpoint: a finished run, its last one damaged')
def _(p):
  run = p.trained()
  damage(run / 'checkpoints' / '6', 'bytes')
  verdict = survived(p.run(*p.train(run, 6)), ['resuming from step 3', 'checksums'])
  return verdict if steps_once(run, 6) else ('BAD', 'steps 4-6 not trained again')


@case('checkpoint: newest with bytes changed')
def _(p):
  run = p.trained()
  damage(run / 'checkpoints' / '6', 'bytes')
  verdict = resumed(p.run(*p.train(run, 9)), ['resuming from step 3', 'checksums'], run, 9)
  # Orbax restores changed bytes without an error: the checksums catch them, and the damaged
  # checkpoint is set aside, not deleted.
  return verdict if verdict[0] != 'GOOD' or (run / 'checkpoints-damaged' / '6').is_dir() else (
      'BAD', 'the damaged checkpoint was not set aside in checkpoints-damaged/6')


@case('checkpoint: every one damaged, and the next run')
def _(p):
  run = p.trained()
  before = (run / 'metrics.jsonl').read_text()
  for step in (3, 6):
    damage(run / 'checkpoints' / str(step), 'truncate')
  first, second = p.run(*p.train(run, 9)), p.run(*p.train(run, 9))
  if (run / 'metrics.jsonl').read_text() != before:
    return 'BAD', 'the old run\'s metrics were replaced'
  last = lines(first.stderr)[-1:]
  if first.returncode != 2 or not last or 'moved to' not in last[0]:
    return 'UGLY', f'first run: exit {first.returncode}, {last}'
  aside = run / 'checkpoints-damaged'
  if not aside.is_dir() or sorted(x.name for x in aside.iterdir()) != ['3', '6']:
    return 'BAD', f'the damaged checkpoints are not both in {aside}'
  return refused(second, 'every checkpoint of this run is damaged')


def damaged_reader(p, *args, how='bytes'):
  run = p.trained()
  damage(run / 'checkpoints' / '6', how)
  return run, [a.format(run=run, out=p.path('out')) for a in args]


def refused_damaged(result, run, untouched=()):
  """A reader's refusal of checkpoint 6 whose bytes changed: it names the checkpoint, the
  checksums and the checkpoints left, before writing anything, and leaves the damaged one."""
  verdict = refused(result, f'checkpoint {run}/checkpoints/6 is damaged', untouched)
  if verdict[0] == 'GOOD' and not ('arrays differ from their checksums: params.' in result.stderr
                                   and 'The run has checkpoints [3] too' in result.stderr):
    return 'UGLY', f'does not name the arrays or checkpoint 3: {lines(result.stderr)[-1][:160]}'
  return verdict if (run / 'checkpoints' / '6').is_dir() else ('BAD', 'checkpoint 6 is gone')


@case('checkpoint: sample.py from one whose metadata does not read')
def _(p):
  run, args = damaged_reader(p, 'sample.py', '--workdir={run}', '--max_new_tokens=4',
                             how='truncate')
  return refused(p.run(*args), f'--workdir: checkpoint {run}/checkpoints/6 is damaged (its '
                 'metadata does not read); it is left as it is. The run has checkpoints [3] too')


@case('checkpoint: sample.py from a damaged one')
def _(p):
  run, args = damaged_reader(p, 'sample.py', '--workdir={run}', '--max_new_tokens=4')
  return refused_damaged(p.run(*args), run)


@case('checkpoint: export.py from a damaged one')
def _(p):
  run, args = damaged_reader(p, 'export.py', '--workdir={run}', '--output={out}')
  return refused_damaged(p.run(*args), run, [args[-1][9:]])


@case('checkpoint: evaluate.py from a damaged one')
def _(p):
  run, args = damaged_reader(p, 'evaluate.py', '--workdir={run}', '--tasks=stdlib_next_line',
                             '--limit=2', '--output={out}')
  return refused_damaged(p.run(*args), run, [args[-1][9:]])


@case('evaluate: its output file exists')
def _(p):
  output = p.path('results.json')
  output.write_text('{"kept": true}\n')
  result = p.run('evaluate.py', f'--workdir={p.template}', '--tasks=stdlib_next_line',
                 f'--output={output}')
  if output.read_text() != '{"kept": true}\n':
    return 'BAD', f'{output} was changed'
  return refused(result, f'--output={output} exists')


@case('evaluate: a task it does not know')
def _(p):
  return refused(p.run('evaluate.py', f'--workdir={p.template}', '--tasks=hellaswagg'),
                 '--tasks: no lm-eval task named hellaswagg')


EVALUATE_FLAGS = {  # name: (arguments after evaluate.py's, what the line must say)
    'missing --workdir': (['--tasks=stdlib_next_line'], '--workdir is required'),
    '--batch_size=0': (['--workdir=/nonexistent', '--tasks=stdlib_next_line', '--batch_size=0'],
                       '--batch_size=0 must be at least 1'),
    '--log_samples without --output': (['--workdir=/nonexistent', '--tasks=stdlib_next_line',
                                        '--log_samples'], '--log_samples needs --output=FILE'),
}
for _name, (_args, _expected) in EVALUATE_FLAGS.items():
  CASES[f'evaluate: {_name}'] = (lambda p, args=_args, expected=_expected:
                                 refused(p.run('evaluate.py', *args), expected))


@case('evaluate: --tasks= names none')
def _(p):
  return refused(p.run('evaluate.py', f'--workdir={p.template}', '--tasks='),
                 "--tasks='' names no task")


@case('evaluate: --include_path a directory that is not there')
def _(p):
  return refused(p.run('evaluate.py', f'--workdir={p.template}', '--tasks=stdlib_next_line',
                       '--include_path=/nonexistent/tasks'),
                 '--include_path: /nonexistent/tasks is not a directory')


@case('evaluate: --num_fewshot=-1')
def _(p):
  return refused(p.run('evaluate.py', f'--workdir={p.template}', '--tasks=stdlib_next_line',
                       '--num_fewshot=-1'), '--num_fewshot=-1 must be at least 0')


@case('evaluate: a run trained with cuDNN attention, on a machine without cuDNN')
def _(p):
  # What a GPU run with attention='cudnn' saves, as its checkpoints' configs (no GPU here).
  run = p.trained()
  for metadata in run.glob('checkpoints/*/config/metadata'):
    config = json.loads(metadata.read_text())
    config['model']['attention'] = 'cudnn'
    metadata.write_text(json.dumps(config))
  return survived(p.run('evaluate.py', f'--workdir={run}', '--tasks=stdlib_next_line',
                        '--limit=4'), ['"stdlib_next_line": {"acc"'])


@case('sample, export, evaluate: a hierarchical run on fewer devices than it trained on')
def _(p):
  run = p.path('run')
  first = p.run(*p.train(run, 3), '--config.partition.hierarchical=True', '--config.mesh.data=2',
                '--config.mesh.fsdp=-1')
  if first.returncode:
    return 'BAD', f'the run failed: {lines(first.stderr)[-1:]}'
  for args in (('sample.py', f'--workdir={run}', '--max_new_tokens=4'),
               ('export.py', f'--workdir={run}', f'--output={p.path("export")}'),
               ('evaluate.py', f'--workdir={run}', '--tasks=stdlib_next_line', '--limit=4')):
    if (verdict := survived(p.run(*args, devices=1)))[0] != 'GOOD':
      return verdict[0], f'{args[0]}: {verdict[1]}'
  return 'GOOD', 'sampled, exported and evaluated on 1 device'


def task_dir(p, name: str, **changes) -> pathlib.Path:
  """A directory holding stdlib_complete as task `name`, its YAML's lines changed by `changes`
  (the line's start: the whole new line), with a module `faulty` whose metric raises."""
  tasks = p.path('tasks')
  tasks.mkdir()
  for file in ('stdlib.py', 'stdlib_complete.jsonl'):
    shutil.copy(REPO / 'evaluation' / 'tasks' / file, tasks)
  (tasks / 'faulty.py').write_text('def results(doc, results):\n'
                                   '  raise RuntimeError("a metric of the task\'s own failed")\n')
  lines = (REPO / 'evaluation' / 'tasks' / 'stdlib_complete.yaml').read_text().splitlines()
  lines = [next((new for old, new in changes.items() if line.lstrip().startswith(old)), line)
           for line in lines if not line.startswith('task:')]
  (tasks / f'{name}.yaml').write_text('\n'.join([f'task: {name}', *lines]) + '\n')
  return tasks


@case('lm-eval: a generation longer than the run\'s rows, asked during training')
def _(p):
  tasks = task_dir(p, 'too_long', **{'max_gen_toks:': '  max_gen_toks: 4096'})
  workdir = p.path('run')
  return refused(p.run(*p.train(workdir), '--config.lm_eval.tasks=too_long',
                       f'--config.lm_eval.include_path={tasks}'),
                 'config.lm_eval.tasks: too_long asks for 4096 new tokens', [workdir])


@case('lm-eval: a task whose documents are not there, asked during training')
def _(p):
  tasks = task_dir(p, 'unread')
  (tasks / 'stdlib_complete.jsonl').unlink()
  workdir = p.path('run')
  return refused(p.run(*p.train(workdir), '--config.lm_eval.tasks=unread',
                       f'--config.lm_eval.include_path={tasks}'),
                 'config.lm_eval.tasks: lm-eval could not build unread: FileNotFoundError',
                 [workdir])


@case('lm-eval: a task fails during training')
def _(p):
  tasks = task_dir(p, 'faulty', **{'metric_list:': 'process_results: !function faulty.results\n'
                                   'metric_list:'})
  workdir = p.path('run')
  result = p.run(*p.train(workdir), '--config.lm_eval.tasks=faulty', '--config.lm_eval.every=3',
                 '--config.lm_eval.limit=2', f'--config.lm_eval.include_path={tasks}')
  verdict = survived(result, ["lm-eval's tasks (faulty) were not scored: RuntimeError: a metric "
                              "of the task's own failed", 'training goes on'])
  saved = sorted(int(d.name) for d in (workdir / 'checkpoints').iterdir() if d.name.isdigit())
  if verdict[0] == 'GOOD' and not (steps_once(workdir, 6) and saved == [3, 6]):
    return 'BAD', f'steps or checkpoints lost: checkpoints {saved}'
  return verdict


@case('checkpoint: init_from a damaged one')
def _(p):
  run, _ = damaged_reader(p)
  new = p.path('new')  # stopped before its first step: no metrics, no checkpoint
  return refused_damaged(p.run(*p.train(new), f'--config.init_from={run}'), run,
                         [new / 'metrics.jsonl', new / 'checkpoints' / '3'])


@case('non-finite: learning rate 1e30')
def _(p):
  result = p.run(*p.train(p.path('nan'), 12), '--config.optimizer.learning_rate=1e30',
                 '--config.optimizer.warmup_steps=0', '--config.max_bad_steps=2')
  # 1e30 is finite, so it is accepted; from step 2 on every step is skipped, and the stop reads
  # as the steps' warnings and one error line (exit 2).
  err = lines(result.stderr)
  if result.returncode != 2 or 'Traceback' in result.stderr:
    return 'UGLY', f'exit {result.returncode}, {len(err)} lines'
  skipped = [f'warning: step {step}: the loss or gradient is not finite; the step was skipped'
             for step in (2, 3)]
  if err[:-1] != skipped:
    return 'UGLY', f'other lines: {[l for l in err[:-1] if l not in skipped][:2]}'
  return ('GOOD', err[-1][:160]) if err[-1].startswith(
      'error: steps 2..3: 2 steps in a row had a non-finite loss or gradient '
      '(config.max_bad_steps=2); no checkpoint was saved.') else ('UGLY', err[-1][:160])


@case('disk: full during a training save')
def _(p):
  """The first save's array files are past the limit (the prepared data and the cached programs
  are not): the save fails in orbax's background thread and the run stops at once, rather than
  train on with nothing saved; the next run, with room, clears the unfinished save and trains
  as an uninterrupted run."""
  workdir = p.path('full')
  verdict = refused(p.run(*p.train(workdir, 12), file_size_limit=300_000),
                    f'saving checkpoint 3 to {workdir}/checkpoints: File too large; raise the '
                    'file size limit (ulimit -f)')
  if verdict[0] != 'GOOD':
    return verdict
  if not 3 <= max(r['step'] for r in metrics(workdir)) <= 5:
    return 'BAD', 'trained on past the failed save'
  if whole := [c.name for c in (workdir / 'checkpoints').glob('*') if c.name.isdigit()]:
    return 'BAD', f'checkpoints {whole} look whole'  # the unfinished save is the next run's
  again = p.run(*p.train(workdir, 12))
  if 'resuming' in again.stdout:
    return 'BAD', 'the next run resumed from an unfinished save'
  return as_uninterrupted(p, resumed(again, ['step 12/12'], workdir, 12), workdir)


@case('disk: full under an export')
def _(p):
  out = p.path('export')
  verdict = refused(p.run('export.py', f'--workdir={p.template}', f'--output={out}',
                          file_size_limit=100_000), 'File too large', [out])
  leftovers = list(out.parent.glob(f'.{out.name}.partial-*'))
  return verdict if not leftovers else ('BAD', f'left {leftovers}')


@case('data: truncated prepared split')
def _(p):
  data = p.root / 'tfds-damaged'
  shutil.copytree(p.root / 'tfds', data)
  for f in data.rglob('*-train.array_record*'):
    with open(f, 'r+b') as file:
      file.truncate(f.stat().st_size // 2)
  p.env['TFDS_DATA_DIR'] = str(data)
  try:
    return refused(p.run(*p.train(p.path('x'))), 'is damaged; prepare it again')
  finally:
    p.env['TFDS_DATA_DIR'] = str(p.root / 'tfds')


def chat_records(p, rows) -> pathlib.Path:
  path = p.path('chat').with_suffix('.jsonl')
  path.write_text(''.join(line + '\n' for line in rows))
  return path


def good_chat(i: int) -> str:
  return json.dumps({'messages': [{'role': 'user', 'content': f'Two and {i}?'},
                                  {'role': 'assistant', 'content': f'{i + 2}.'}]})


def none_holds(rows, record):
  """A case: a record file none of whose 4 records holds what `record` reads, refused naming it."""
  def probe(p):
    path, workdir = chat_records(p, rows), p.path('x')
    return refused(p.run(*p.train(workdir, 1, f'--config.data.paths={path}',
                                  f'--config.data.record={record}')),
                   "none of the 4 records of its 1 record file(s) holds what "
                   f"config.data.record={record!r} reads", [workdir])
  return probe


def some_bad(rows, record, warning):
  """A case: 12 good records and 2 bad ones after them: trained on, the bad counted in one line."""
  def probe(p):
    path = chat_records(p, rows)
    result = p.run(*p.train(p.path('x'), 1, f'--config.data.paths={path}',
                            f'--config.data.record={record}',
                            '--config.data.validation_fraction=0.2'))
    warned = [line for line in lines(result.stderr) if warning in line]
    verdict = survived(result)
    return verdict if verdict[0] != 'GOOD' or len(warned) == 1 else ('UGLY', 'no one-line count')
  return probe


def good_pair(i: int) -> str:
  return json.dumps({'prompt': f'Two and {i}? ', 'chosen': f'{i + 2}.', 'rejected': f'{i + 3}.'})


def good_chat_pair(i: int) -> str:
  return json.dumps({'prompt': [{'role': 'user', 'content': f'Two and {i}?'}],
                     'chosen': [{'role': 'assistant', 'content': f'{i + 2}.'}],
                     'rejected': f'{i + 3}.'})


CASES['data: chat records that hold no conversation'] = none_holds(
    [json.dumps({'text': f'document {i}'}) for i in range(4)], 'messages')
CASES['data: chat records, some bad'] = some_bad(
    [good_chat(i) for i in range(12)] + ['{"messages": [', json.dumps({'messages': 'hi'})],
    'messages', 'skipped 2 of 14 records (line 13')
CASES['data: preference records that hold no pair'] = none_holds(
    [good_chat(i) for i in range(4)], 'preference')
CASES['data: preference records, some bad'] = some_bad(
    [good_pair(i) for i in range(12)] + [
        json.dumps({'prompt': 'Q', 'chosen': 'same', 'rejected': 'same'}),
        json.dumps({'prompt': 'Q', 'chosen': 'a'})],
    'preference', 'skipped 2 of 14 records (line 13: fields')
CASES['data: chat pairs given as plain preference records'] = none_holds(
    [good_chat_pair(i) for i in range(4)], 'preference')
CASES['data: chat pairs, some bad'] = some_bad(
    [good_chat_pair(i) for i in range(12)] + [
        json.dumps({'prompt': [{'role': 'user', 'content': 'Q'}],
                    'chosen': [{'role': 'assistant', 'content': 'A'}],
                    'rejected': [{'role': 'user', 'content': 'B'}]}),
        json.dumps({'prompt': 'Q', 'chosen': 'a', 'rejected': 'b'})],
    'chat_preference', "skipped 2 of 14 records (line 13: rejected[0] has role 'user'")



def long_prompt_pair(i: int) -> str:
  """A pair whose 310-byte prompt fills more than its share of a 128-token byte row."""
  return json.dumps({'prompt': f'Question {i}: ' + 'why ' * 75, 'chosen': f'{i + 2}.',
                     'rejected': f'{i + 3}.'})


@case('data: preference prompts longer than the row')
def _(p):
  path, workdir = chat_records(p, [long_prompt_pair(i) for i in range(300)]), p.path('x')
  return refused(p.run(*p.train(workdir, 1, f'--config.data.paths={path}',
                                '--config.data.record=preference', '--config.seq_len=128')),
                 'keeps anything to learn from in a row of config.seq_len=128', [workdir])


CASES['data: preference pairs, some cut to nothing'] = some_bad(
    [good_pair(i) for i in range(12)] + [long_prompt_pair(i) for i in range(2)],
    'preference', 'skipping 2 of 14 preference pairs that keep nothing to learn from')


def tokens_dir_copy(p) -> pathlib.Path:
  """A copy of the prepared corpora, in which the cases below prepare token ids."""
  p.template  # noqa: B018  (trained once, which prepares the corpus)
  data = p.path('tfds')
  shutil.copytree(p.root / 'tfds', data, ignore=shutil.ignore_patterns('meshlm_tokens'))
  return data


@case('data: damaged prepared token ids')
def _(p):
  data = tokens_dir_copy(p)
  once = ('--config.data.tokenize=once', f'--config.data.data_dir={data}')
  first = p.run(*p.train(p.path('x'), 1, *once))
  if first.returncode:
    return 'BAD', f'preparing them failed: {lines(first.stderr)[-1:]}'
  for f in data.glob('meshlm_tokens/*/train.array_record'):
    with open(f, 'r+b') as file:
      file.truncate(f.stat().st_size // 2)
  return refused(p.run(*p.train(p.path('y'), 1, *once)),
                 'are damaged; delete that directory and the next run prepares them again')


@case('disk: full while preparing token ids')
def _(p):
  data = tokens_dir_copy(p)
  result = p.run(*p.train(p.path('x'), 1, '--config.data.tokenize=once',
                          f'--config.data.data_dir={data}'), file_size_limit=100_000)
  verdict = refused(result, 'File too large')
  leftovers = [f for f in data.glob('meshlm_tokens/**/*') if f.is_file()]
  return verdict if not leftovers else ('BAD', f'left {leftovers}')


SAMPLING = {
    'missing --workdir': ([], '--workdir is required'),
    'no checkpoint there': (['--workdir=/tmp'], 'holds no checkpoint'),
    'temperature -1': (['--workdir=/nonexistent', '--temperature=-1'], '--temperature=-1.0'),
    'temperature NaN': (['--workdir=/nonexistent', '--temperature=nan'], '--temperature=nan'),
    'max_new_tokens 0': (['--workdir=/nonexistent', '--max_new_tokens=0'], '--max_new_tokens=0'),
    'top_k -1': (['--workdir=/nonexistent', '--top_k=-1'], '--top_k=-1'),
    'top_p 0': (['--workdir=/nonexistent', '--top_p=0'], '--top_p=0.0 must be in (0, 1]'),
    'top_p above 1': (['--workdir=/nonexistent', '--top_p=1.5'], '--top_p=1.5 must be in (0, 1]'),
    'unknown cache kind': (['--workdir=/nonexistent', '--kv_cache=int2'], "--kv_cache='int2'"),
    'ten million tokens': (['--workdir={run}', '--max_new_tokens=10000000'], 'seq_len it was'),
    'max_len ten million': (['--workdir={run}', '--max_len=10000010',
                             '--max_new_tokens=10000000'], 'more than 16×'),
}


def sampling_case(args, expected):
  def probe(p):
    return refused(p.run('sample.py', *[a.format(run=p.template) for a in args]), expected)
  return probe


for _name, (_args, _expected) in SAMPLING.items():
  CASES[f'sample.py: {_name}'] = sampling_case(_args, _expected)


@case('export.py: a step that does not exist')
def _(p):
  return refused(p.run('export.py', f'--workdir={p.template}', '--step=7',
                       f'--output={p.path("out")}'), 'checkpoints of steps [3, 6]')


@case('export.py: a non-empty output')
def _(p):
  out = p.path('out')
  out.mkdir()
  (out / 'mine').write_text('mine')
  verdict = refused(p.run('export.py', f'--workdir={p.template}', f'--output={out}'),
                    'is not an empty directory')
  return verdict if (out / 'mine').read_text() == 'mine' else ('BAD', 'overwritten')


@case('export.py: --lora=peft of a run without adapters')
def _(p):
  out = p.path('out')
  return refused(p.run('export.py', f'--workdir={p.template}', f'--output={out}', '--lora=peft'),
                 'has no adapters', [out])


@case('export.py: --max_shard_gb=0')
def _(p):
  return refused(p.run('export.py', f'--workdir={p.template}', f'--output={p.path("o")}',
                       '--max_shard_gb=0'), '--max_shard_gb=0.0 must be positive')


@case('export.py: files as readable as the user\'s')
def _(p):
  out = p.path('out')
  verdict = survived(p.run('export.py', f'--workdir={p.template}', f'--output={out}'))
  umask = os.umask(0o022)
  os.umask(umask)
  modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
  wrong = {n: m for n, m in modes.items() if m != oct(0o666 & ~umask)}
  return verdict if not wrong else ('UGLY', f'modes {wrong}')


@case('tokenizer: vocabulary too small')
def _(p):
  return refused(p.run('-m', 'data.train_tokenizer', '--config=configs/default.py',
                       '--vocab_size=100', f'--output={p.path("spm")}'), '--vocab_size=100')


@case('tokenizer: missing config file')
def _(p):
  return refused(p.run('-m', 'data.train_tokenizer', '--config=configs/nope.py',
                       f'--output={p.path("spm")}'), 'no such config file')


@case('metrics: TensorBoard after a resume')
def _(p):
  import logging
  from tensorboard.backend.event_processing import event_accumulator
  logging.getLogger('tensorboard').setLevel(logging.ERROR)  # it reports the purge it applies
  run = p.trained()
  damage(run / 'checkpoints' / '6', 'truncate')  # steps 4..6 are logged again
  verdict = survived(p.run(*p.train(run, 9)))
  events = event_accumulator.EventAccumulator(str(run), size_guidance={'scalars': 0})
  events.Reload()
  shown = [e.step for e in events.Scalars('loss')]
  return verdict if shown == list(range(1, 10)) else ('BAD', f'TensorBoard shows {shown}')


# Round three (issue 48): what a run trains with is its own, compared by what each setting
# declares it changes (configs/base.py: EFFECTS), and nothing is trained from nothing.

CHATML = REPO / 'tests' / 'data' / 'hf-chat' / 'chatml'  # a tokenizer.json with a chat template
LLAMA3_CHAT = REPO / 'tests' / 'data' / 'hf-chat' / 'llama3'


def chat_corpus(p, n=40, answer=lambda i: f'{i + 2}.') -> pathlib.Path:
  return chat_records(p, [json.dumps({'messages': [
      {'role': 'user', 'content': f'Two and {i}?'},
      {'role': 'assistant', 'content': answer(i)}]}) for i in range(n)])


def chat_train(p, workdir, path, steps=6, *more):
  return p.train(workdir, steps, f'--config.data.paths={path}', '--config.data.record=messages',
                 '--config.data.validation_fraction=0.2', '--config.seq_len=64', *more)


def trained_with(p, name, *args, steps=6):
  """A run of `args` (6 steps, checkpoints at 3 and 6), trained once and copied per case."""
  template = p.root / f'template-{name}'
  if not template.exists():
    result = p.run(*p.train(template, steps), *args)
    assert result.returncode == 0, result.stderr[-3000:]
  copy = p.path(name)
  shutil.copytree(template, copy)
  return copy


LORA = ('--config.model.lora_rank=4', '--config.model.lora_alpha=32')


def lora_run(p):
  return trained_with(p, 'lora', f'--config.init_from={p.template}', *LORA)


RESUMED_CHANGES = {  # name: (the run's arguments, the change, what the refusal names)
    'LoRA alpha ×10': (LORA, '--config.model.lora_alpha=320', 'config.model.lora_alpha=320.0'),
    'LoRA targets': (LORA, '--config.model.lora_targets=q,v', 'config.model.lora_targets'),
    'MoE experts per token': (MOE, '--config.model.experts_per_token=4',
                              'config.model.experts_per_token=4'),
    'MoE router': (MOE, '--config.model.router=sigmoid', "config.model.router='sigmoid'"),
    'MoE renormalisation': (MOE, '--config.model.router_renormalize=False',
                            'config.model.router_renormalize=False'),
    'MoE capacity factor': (MOE, '--config.model.capacity_factor=1.0',
                            'config.model.capacity_factor=1.0'),
    'RoPE scaling': ((), '--config.model.rope_type=llama3', "config.model.rope_type='llama3'"),
    'sliding window': ((), '--config.model.sliding_window=8', 'config.model.sliding_window=8'),
    'chat template setting': ((), '--config.data.chat_template=fallback',
                              "config.data.chat_template='fallback'"),
    'init_from': ((), '--config.init_from={template}', "config.init_from='{template}'"),
}


def resumed_change_case(args, change, expected):
  def probe(p):
    run = (lora_run(p) if args == LORA else trained_with(p, 'moe', *MOE) if args == MOE
           else p.trained())
    before = (run / 'metrics.jsonl').read_text()
    extra = ((f'--config.init_from={p.template}',) if args == LORA else ()) + args
    verdict = refused(p.run(*p.train(run, 9), *extra, change.format(template=p.template)),
                      expected.format(template=p.template))
    return verdict if (run / 'metrics.jsonl').read_text() == before else ('BAD', 'metrics changed')
  return probe


for _name, (_args, _change, _expected) in RESUMED_CHANGES.items():
  CASES[f'resume: {_name}'] = resumed_change_case(_args, _change, _expected)


@case('resume: a finished run')
def _(p):
  run = p.trained()
  before = (run / 'metrics.jsonl').read_text()
  verdict = survived(p.run(*p.train(run, 6)), ['is finished: checkpoint 6 is its last step'])
  return verdict if (run / 'metrics.jsonl').read_text() == before else ('BAD', 'metrics changed')


@case('resume: compute dtype under LoRA')
def _(p):
  run = lora_run(p)
  result = p.run(*p.train(run, 9), f'--config.init_from={p.template}', *LORA,
                 '--config.model.compute_dtype=float32')
  return resumed(result, ['resuming from step 6'], run, 9)


@case('resume: learning rate and mesh, allowed')
def _(p):
  run = p.trained()
  result = p.run(*p.train(run, 9), '--config.optimizer.learning_rate=1e-3', '--config.mesh.fsdp=2',
                 '--config.mesh.data=4', '--config.train_steps=9')
  return survived(result, ['resuming from step 6'])


def template_copy_edited(p, entry):
  """A case: a run's own copy of its chat template edited; `entry` (sample.py, or train.py
  resuming) refuses it, naming the copy."""
  path, run = chat_corpus(p), p.path('run')
  first = p.run(*chat_train(p, run, path, 3))
  if first.returncode:
    return 'BAD', f'the first run failed: {lines(first.stderr)[-1:]}'
  kept = run / 'chat_template.jinja'
  kept.write_text(kept.read_text().replace('<|im_start|>', '<|im_begin|>'))
  if entry == 'train.py':
    return refused(p.run(*chat_train(p, run, path, 6)), f'{kept}: the chat template is')
  return refused(p.run('sample.py', f'--workdir={run}', '--chat', '--prompt=Two and 3?',
                       '--max_new_tokens=8'), f'{kept}: the chat template is')


for entry in ('sample.py', 'train.py'):
  CASES[f'{entry.removesuffix(".py")}: the run\'s chat template copy edited'] = (
      lambda p, entry=entry: template_copy_edited(p, entry))


@case('resume: records edited')
def _(p):
  path = chat_corpus(p)
  run = p.path('run')
  first = p.run(*chat_train(p, run, path))
  if first.returncode:
    return 'BAD', f'the first run failed: {lines(first.stderr)[-1:]}'
  text = path.read_text().replace('Two and 7?', 'Two and seven?')
  path.write_text(text)
  return refused(p.run(*chat_train(p, run, path, 9)), 'config.data.paths: the corpus')


@case('resume: records touched, not changed')
def _(p):
  path = chat_corpus(p)
  run = p.path('run')
  first = p.run(*chat_train(p, run, path))
  if first.returncode:
    return 'BAD', f'the first run failed: {lines(first.stderr)[-1:]}'
  os.utime(path)  # a newer modification time: prepared afresh, the same documents
  return resumed(p.run(*chat_train(p, run, path, 9)), ['resuming from step 6'], run, 9)


def hf_tokenizer(p, source=CHATML) -> pathlib.Path:
  directory = p.path('tok')
  shutil.copytree(source, directory)
  return directory / 'tokenizer.json'


@case('resume: tokenizer replaced at its path')
def _(p):
  tok = hf_tokenizer(p)
  run = p.path('run')
  args = ('--config.data.tokenizer=hf', f'--config.data.tokenizer_model={tok}')
  first = p.run(*p.train(run), *args)
  if first.returncode:
    return 'BAD', f'the first run failed: {lines(first.stderr)[-1:]}'
  shutil.copyfile(LLAMA3_CHAT / 'tokenizer.json', tok)
  shutil.copyfile(LLAMA3_CHAT / 'tokenizer_config.json', tok.with_name('tokenizer_config.json'))
  verdict = refused(p.run(*p.train(run, 9), *args), 'but the run in')
  return verdict if verdict[0] != 'GOOD' or 'hf-' in verdict[1] else ('UGLY', verdict[1])


def copy_replaced(p, entry):
  """A case: a run's own copy of its tokenizer (WORKDIR/tokenizer/) replaced by another one;
  `entry` (sample.py or export.py) refuses it, naming the copy, and writes nothing."""
  tok = hf_tokenizer(p)
  run = p.path('run')
  tokenizer = ('--config.data.tokenizer=hf', f'--config.data.tokenizer_model={tok}')
  first = p.run(*p.train(run, 3), *tokenizer)
  if first.returncode:
    return 'BAD', f'the first run failed: {lines(first.stderr)[-1:]}'
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copyfile(LLAMA3_CHAT / name, run / 'tokenizer' / name)
  out = p.path('export')
  if entry == 'train.py':  # resumed: the original is intact, the run's copy is not
    return refused(p.run(*p.train(run, 6), *tokenizer), f"{run / 'tokenizer'}: the tokenizer is")
  args = [f'--output={out}'] if entry == 'export.py' else ['--prompt=def ', '--max_new_tokens=8']
  return refused(p.run(entry, f'--workdir={run}', *args),
                 f"{run / 'tokenizer'}: the tokenizer is", [out])


for entry in ('sample.py', 'export.py', 'train.py'):
  CASES[f'{entry.removesuffix(".py")}: the run\'s tokenizer copy replaced'] = (
      lambda p, entry=entry: copy_replaced(p, entry))


@case('resume: tokenizer moved away')
def _(p):
  tok = hf_tokenizer(p)
  run = p.path('run')
  args = ('--config.data.tokenizer=hf', f'--config.data.tokenizer_model={tok}')
  first = p.run(*p.train(run), *args)
  if first.returncode:
    return 'BAD', f'the first run failed: {lines(first.stderr)[-1:]}'
  shutil.rmtree(tok.parent)
  return resumed(p.run(*p.train(run, 9), *args), ['resuming from step 6'], run, 9)


@case('tokenizer: trained over an existing one')
def _(p):
  out = p.path('spm')
  out.with_name(out.name + '.model').write_text('mine')
  result = p.run('-m', 'data.train_tokenizer', '--config=configs/base.py',
                 f'--config.data.paths={CORPUS}', '--vocab_size=300', f'--output={out}')
  verdict = refused(result, 'is never written over another')
  return verdict if out.with_name(out.name + '.model').read_text() == 'mine' else (
      'BAD', 'overwritten')


@case('data: stdlib_chat over another file')
def _(p):
  out = p.path('mine').with_suffix('.jsonl')
  out.write_text('{"mine": 1}\n')
  verdict = refused(p.run('-m', 'data.stdlib_chat', f'--output={out}', '--max_records=10'),
                    'is never written over')
  return verdict if out.read_text() == '{"mine": 1}\n' else ('BAD', 'overwritten')


def template_file(p, text) -> pathlib.Path:
  path = p.path('template').with_suffix('.jinja')
  path.write_text(text)
  return path


CUSTOM = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant] {% endif %}")


@case('init_from: a run that trained with its own chat template')
def _(p):
  path, template = chat_corpus(p), template_file(p, CUSTOM)
  tok = hf_tokenizer(p, LLAMA3_CHAT)  # a tokenizer whose own template is another
  tokenizer = ('--config.data.tokenizer=hf', f'--config.data.tokenizer_model={tok}')
  sft, dpo = p.path('sft'), p.path('next')
  first = p.run(*chat_train(p, sft, path, 3, *tokenizer,
                            f'--config.data.chat_template={template}'))
  if first.returncode:
    return 'BAD', f'the first run failed: {lines(first.stderr)[-1:]}'
  result = p.run(*chat_train(p, dpo, path, 3, f'--config.init_from={sft}'))
  verdict = survived(result, ['the chat template sha256:'])
  kept = dpo / 'chat_template.jinja'
  if verdict[0] == 'GOOD' and (not kept.is_file() or kept.read_text() != CUSTOM):
    return 'BAD', 'the run renders with another template than the one it started from'
  return verdict


def lora_start(p, setting):
  """A case: a run started from a LoRA run, with config.init_adapters=`setting`: its start line
  says what it did with the adapters, and the two starts are other models."""
  run, out = lora_run(p), {}
  for each in ('merge', 'leave'):
    result = p.run(*p.train(p.path(f'from-lora-{each}'), 1), f'--config.init_from={run}',
                   f'--config.init_adapters={each}', '--config.eval_every=0')
    out[each] = result
  merged, left = (float(next(line for line in r.stdout.splitlines() if 'loss' in line)
                        .split('loss ')[1].split()[0]) if r.returncode == 0 else None
                  for r in (out['merge'], out['leave']))
  expected = {'merge': 'its LoRA adapters (rank 4) merged into the base',
              'leave': "its LoRA adapters (rank 4) left out (config.init_adapters='leave')"}
  verdict = survived(out[setting], [expected[setting]])
  if verdict[0] == 'GOOD' and merged == left:
    return 'BAD', f'the two starts train the same model (loss {merged})'
  return verdict


for _setting, _done in (('merge', 'merged'), ('leave', 'left out')):
  CASES[f'init_from: a LoRA run, its adapters {_done}'] = (
      lambda p, setting=_setting: lora_start(p, setting))


@case('export: a custom chat template goes with it')
def _(p):
  path, template = chat_corpus(p), template_file(p, CUSTOM)
  run, out = p.path('run'), p.path('export')
  first = p.run(*chat_train(p, run, path, 3, f'--config.data.chat_template={template}'))
  if first.returncode:
    return 'BAD', f'the run failed: {lines(first.stderr)[-1:]}'
  verdict = survived(p.run('export.py', f'--workdir={run}', f'--output={out}'))
  exported = json.loads((out / 'tokenizer_config.json').read_text()).get('chat_template')
  return verdict if exported == CUSTOM else ('BAD', 'the export carries another template')


@case('sample.py: --chat after the template file moved')
def _(p):
  path, template = chat_corpus(p), template_file(p, CUSTOM)
  run = p.path('run')
  first = p.run(*chat_train(p, run, path, 3, f'--config.data.chat_template={template}'))
  if first.returncode:
    return 'BAD', f'the run failed: {lines(first.stderr)[-1:]}'
  template.unlink()
  return survived(p.run('sample.py', f'--workdir={run}', '--chat', '--prompt=Two and 3?',
                        '--max_new_tokens=4'))


@case('resume: chat template file edited')
def _(p):
  path, template = chat_corpus(p), template_file(p, CUSTOM)
  run = p.path('run')
  args = (f'--config.data.chat_template={template}',)
  first = p.run(*chat_train(p, run, path, 3, *args))
  if first.returncode:
    return 'BAD', f'the run failed: {lines(first.stderr)[-1:]}'
  template.write_text(CUSTOM.replace('[', '<'))
  return refused(p.run(*chat_train(p, run, path, 6, *args)), 'config.data.chat_template:')


@case('hf: without tokenizer.json')
def _(p):
  hf = p.path('hf')
  shutil.copytree(HF, hf)
  (hf / 'tokenizer.json').unlink()
  workdir = p.path('refused')
  return refused(p.run(*p.train(workdir), f'--config.init_from=hf:{hf}'),
                 'has no tokenizer.json', [workdir])


@case('hf: another tokenizer than its own')
def _(p):
  workdir = p.path('refused')
  tok = hf_tokenizer(p, LLAMA3_CHAT)
  return refused(p.run(*p.train(workdir), f'--config.init_from=hf:{HF}',
                       '--config.data.tokenizer=hf', f'--config.data.tokenizer_model={tok}'),
                 "its embeddings are the first one's ids", [workdir])


@case('hf: a tokenizer larger than its model')
def _(p):
  hf, tok = p.path('hf'), p.path('tok')
  shutil.copytree(HF, hf)
  (hf / 'tokenizer.json').unlink()  # none of its own: the one named is the one used
  made = p.run('-m', 'data.train_tokenizer', '--config=configs/base.py', '--kind=hf',
               f'--config.data.paths={CORPUS}', '--vocab_size=400', f'--output={tok}')
  if made.returncode:
    return 'BAD', f'the tokenizer was not made: {lines(made.stderr)[-1:]}'
  workdir = p.path('refused')
  return refused(p.run(*p.train(workdir), f'--config.init_from=hf:{hf}',
                       '--config.data.tokenizer=hf',
                       f'--config.data.tokenizer_model={tok}/tokenizer.json'),
                 'use the tokenizer it was trained with', [workdir])


@case('init_from: a run of another shape, named')
def _(p):
  workdir = p.path('refused')
  return refused(p.run(*p.train(workdir), f'--config.init_from={p.template}',
                       '--config.model.d_model=32'),
                 f'config.model.d_model=32, but config.init_from={p.template} was trained with '
                 '64', [workdir])


@case('init_from: takes the model it starts from')
def _(p):
  small = trained_with(p, 'small', '--config.model.d_model=32', '--config.model.d_ff=96')
  workdir = p.path('new')
  result = p.run(*p.train(workdir, 3), f'--config.init_from={small}')
  verdict = survived(result, ['starting from the parameters of'])
  saved = json.loads((workdir / 'config.json').read_text())['model'] if verdict[0] == 'GOOD' else {}
  return verdict if saved.get('d_model') == 32 else ('BAD', f'trained d_model {saved.get("d_model")}')


@case('init_from: a run with draft heads')
def _(p):
  heads = trained_with(p, 'heads', '--config.model.draft_heads=2')
  return survived(p.run(*p.train(p.path('new'), 3), f'--config.init_from={heads}'),
                  ['its 2 draft heads left out, this run training none; to keep them: '
                   '--config.model.draft_heads=2'])


@case('init_from: a run of another tokenizer')
def _(p):
  workdir = p.path('refused')
  tok = hf_tokenizer(p)
  return refused(p.run(*p.train(workdir), f'--config.init_from={p.template}',
                       '--config.data.tokenizer=hf', f'--config.data.tokenizer_model={tok}'),
                 'was trained with the byte tokenizer', [workdir])


FROM_NOTHING = {
    'LoRA without init_from': (LORA, 'config.init_from is empty'),
    'draft heads alone without init_from': (('--config.model.draft_heads=2',
                                             '--config.model.draft_only=True'),
                                            'config.init_from is empty'),
    'LoRA rank above the width': (('--config.model.lora_rank=80', '--config.init_from=random'),
                                  'config.model.lora_rank=80'),
    'draft heads as long as the row': (('--config.model.draft_heads=8', '--config.seq_len=8'),
                                       'config.model.draft_heads=8'),
}


def from_nothing_case(args, expected):
  def probe(p):
    workdir = p.path('refused')
    return refused(p.run(*p.train(workdir), *args), expected, [workdir])
  return probe


for _name, (_args, _expected) in FROM_NOTHING.items():
  CASES[f'setting: {_name}'] = from_nothing_case(_args, _expected)


@case('setting: LoRA on a random base, said')
def _(p):
  return survived(p.run(*p.train(p.path('run'), 3), *LORA, '--config.init_from=random'))


@case('data: chat records whose answers are all blank')
def _(p):
  path = chat_corpus(p, answer=lambda i: ' ')
  workdir = p.path('x')
  return refused(p.run(*chat_train(p, workdir, path, 1)), 'every assistant message is blank',
                 [workdir])


@case('data: repeated records stay on one side')
def _(p):
  rows = [good_chat(0)] * 60 + [good_chat(i) for i in range(1, 12)]
  path = chat_records(p, rows)
  data = p.path('tfds')
  result = p.run(*chat_train(p, p.path('x'), path, 1, f'--config.data.data_dir={data}'))
  if result.returncode:
    return 'BAD', f'exit {result.returncode}: {lines(result.stderr)[-1:]}'
  check = p.run('-c', 'import sys, json\nfrom configs import base\nfrom data import corpus\n'
                'c = base.get_config().data\n'
                f'c.paths, c.record, c.data_dir = {str(path)!r}, "messages", {str(data)!r}\n'
                'c.validation_fraction = 0.2\n'
                'k = corpus.load(c)\n'
                'texts = [{k.train[i]["text"] for i in range(len(k.train))},'
                ' {k.validation[i]["text"] for i in range(len(k.validation))}]\n'
                'print(len(texts[0] & texts[1]), len(k.train), len(k.validation))')
  shared, train, validation = map(int, check.stdout.splitlines()[-1].split())
  return (('GOOD', f'{train} train / {validation} validation, none shared') if not shared else
          ('BAD', f'{shared} documents on both sides'))


@case('data: every record alike')
def _(p):
  path = chat_records(p, [good_chat(0)] * 20)
  workdir = p.path('x')
  return refused(p.run(*chat_train(p, workdir, path, 1)), 'distinct', [workdir])


@case('data: a record the chat template refuses')
def _(p):
  template = template_file(p, "{% for m in messages %}{% if m['content'] == 'Two and 5?' %}"
                              "{{ raise_exception('no fives') }}{% endif %}"
                              "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                              "{% if add_generation_prompt %}[assistant] {% endif %}")
  path = chat_corpus(p)
  result = p.run(*chat_train(p, p.path('x'), path, 3, f'--config.data.chat_template={template}'))
  warned = [line for line in lines(result.stderr) if 'skipped 1 of 40 records (line 6' in line]
  verdict = survived(result)
  return verdict if verdict[0] != 'GOOD' or len(warned) == 1 else ('UGLY', 'no one-line count')


@case('data: an empty records file')
def _(p):
  path = chat_records(p, [])
  workdir = p.path('x')
  return refused(p.run(*chat_train(p, workdir, path, 1)), 'hold no records', [workdir])


@case('disk: full while preparing records')
def _(p):
  path = chat_records(p, [good_chat(i) * 1 for i in range(3000)])
  workdir, data = p.path('x'), p.path('tfds')
  result = p.run(*chat_train(p, workdir, path, 1, f'--config.data.data_dir={data}'),
                 file_size_limit=100_000)
  return refused(result, 'config.data.data_dir', [workdir])


@case('data: two runs preparing one data dir')
def _(p):
  path = chat_records(p, [good_chat(i) for i in range(3000)])
  data = p.path('tfds')
  runs = [p.start(*chat_train(p, p.path('x'), path, 1, f'--config.data.data_dir={data}'))
          for _ in range(2)]
  outs = [r.communicate(timeout=600)[0] for r in runs]
  bad = [(r.returncode, lines(o)[-1:]) for r, o in zip(runs, outs) if r.returncode]
  return ('GOOD', 'both trained') if not bad else ('BAD', f'{bad}')


@case('data: a read-only data dir, all prepared')
def _(p):
  data = tokens_dir_copy(p)
  once = ('--config.data.tokenize=once', f'--config.data.data_dir={data}')
  first = p.run(*p.train(p.path('x'), 1, *once))
  if first.returncode:
    return 'BAD', f'preparing failed: {lines(first.stderr)[-1:]}'
  # Read-only as a mount makes it (root ignores a directory's modes), else by its modes.
  mounted = os.geteuid() == 0 and not subprocess.run(
      f'mount --bind {data} {data} && mount -o remount,ro,bind {data}', shell=True,
      capture_output=True).returncode
  if not mounted:
    for path in [data, *data.rglob('*')]:
      path.chmod(path.stat().st_mode & ~0o222)
  try:
    return survived(p.run(*p.train(p.path('y'), 1, *once)))
  finally:
    if mounted:
      subprocess.run(['umount', str(data)], check=True)
    else:
      for path in [data, *data.rglob('*')]:
        path.chmod(path.stat().st_mode | 0o200)


@case('disk: full at the first write of a run')
def _(p):
  p.template  # noqa: B018  (the corpus prepared: the first file the run writes is its own)
  workdir = p.path('full')
  result = p.run(*p.train(workdir), file_size_limit=1000)  # its lock, not its config.json
  verdict = refused(result, str(workdir / 'config.json'))
  empty = [f for f in workdir.rglob('*') if f.is_file() and not f.stat().st_size
           and f.name != '.meshlm-lock']
  return verdict if not empty else ('BAD', f'left empty files {empty}')


@case('export.py: float16 past its range')
def _(p):
  hf = p.path('hf')
  shutil.copytree(HF, hf)
  from safetensors.numpy import load_file, save_file
  tensors = load_file(hf / 'model.safetensors')
  name = next(n for n in tensors if 'mlp.up_proj' in n)
  tensors[name] = tensors[name] * 1e6
  save_file(tensors, hf / 'model.safetensors', metadata={'format': 'pt'})
  run, out = p.path('run'), p.path('export')
  first = p.run(*p.train(run, 1), f'--config.init_from=hf:{hf}',
                '--config.optimizer.learning_rate=0')
  if first.returncode:
    return 'BAD', f'the run failed: {lines(first.stderr)[-1:]}'
  return refused(p.run('export.py', f'--workdir={run}', f'--output={out}', '--dtype=float16'),
                 'up_proj', [out])


@case('sample.py: MoE with a capacity factor, identical prompts')
def _(p):
  run = trained_with(p, 'moe-drops', *MOE_DROPS)
  result = p.run('sample.py', f'--workdir={run}', '--temperature=0', '--max_new_tokens=12',
                 *['--prompt=def '] * 6)
  if result.returncode:
    return 'BAD', f'exit {result.returncode}: {lines(result.stderr)[-1:]}'
  texts = result.stdout.split('--- prompt')[1:]
  return ('GOOD', 'six equal continuations') if len(set(texts)) == 1 and len(texts) == 6 else (
      'BAD', f'{len(set(texts))} different continuations')


@case('sample.py: top_k above the vocabulary')
def _(p):
  return refused(p.run('sample.py', f'--workdir={p.template}', '--top_k=100000',
                       '--max_new_tokens=4'), '--top_k=100000')


@case('sample.py: a prompt past the context')
def _(p):
  return refused(p.run('sample.py', f'--workdir={p.template}', '--prompt=' + 'x' * 200,
                       '--max_new_tokens=4'), 'shorten it')


@case('sample.py: --chat with a template that raises')
def _(p):
  # It renders the training records, and raises on the conversation sample.py asks it for.
  raising = ("{% if messages[-1]['content'] == 'hi' %}{{ raise_exception('no questions') }}"
             "{% endif %}" + CUSTOM)
  path, template = chat_corpus(p), template_file(p, raising)
  run = p.path('run')
  first = p.run(*chat_train(p, run, path, 3, f'--config.data.chat_template={template}'))
  if first.returncode:
    return 'BAD', f'the run failed: {lines(first.stderr)[-1:]}'
  return refused(p.run('sample.py', f'--workdir={run}', '--chat', '--prompt=hi',
                       '--max_new_tokens=4'), '--chat')


@case('export.py: --output under a file')
def _(p):
  file = p.path('file')
  file.write_text('mine')
  verdict = refused(p.run('export.py', f'--workdir={p.template}', f'--output={file}/sub'),
                    'is a file, not a directory')
  return verdict if file.read_text() == 'mine' else ('BAD', 'the file was changed')


@case('export.py: --output empty')
def _(p):
  return refused(p.run('export.py', f'--workdir={p.template}', '--output='), '--output is empty')


@case('export.py: after one killed mid-write')
def _(p):
  out = p.path('export')
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  import socket
  left = out.parent / f'.{out.name}.partial-{socket.gethostname()}-{dead.pid}-abc'
  left.mkdir()
  (left / 'model.safetensors').write_text('half')
  verdict = survived(p.run('export.py', f'--workdir={p.template}', f'--output={out}'))
  return verdict if not left.exists() else ('BAD', f'left {left}')


@case('export.py: PEFT adapter of a run started from a meshlm run')
def _(p):
  run, out = lora_run(p), p.path('adapter')
  result = p.run('export.py', f'--workdir={run}', f'--output={out}', '--lora=peft')
  verdict = survived(result, ['export that first'])
  base = json.loads((out / 'adapter_config.json').read_text())['base_model_name_or_path'] if (
      verdict[0] == 'GOOD') else ''
  return verdict if not base else ('BAD', f'names {base!r}, which PEFT cannot load')


@case('hf: fine-tuned past its context')
def _(p):
  hf = p.path('hf')
  shutil.copytree(HF, hf)
  config = json.loads((hf / 'config.json').read_text())
  (hf / 'config.json').write_text(json.dumps({**config, 'max_position_embeddings': 64}))
  run, out = p.path('run'), p.path('export')
  result = p.run(*p.train(run, 1), f'--config.init_from=hf:{hf}')
  if 'past the 64 positions' not in result.stderr:
    return 'BAD', 'no word of the context'
  verdict = survived(p.run('export.py', f'--workdir={run}', f'--output={out}'))
  declared = json.loads((out / 'config.json').read_text())['max_position_embeddings'] if (
      verdict[0] == 'GOOD') else 0
  return verdict if declared == 128 else ('BAD', f'the export declares {declared}')


@case('plan: fp32 fine-tuning of a 1B head dim on an H100')
def _(p):
  result = p.run('train.py', '--config=configs/finetune.py', '--config.init_from=random',
                 '--config.dry_run=True', '--config.plan.target=H100',
                 '--config.model.head_dim=64', '--config.model.n_heads=32',
                 '--config.model.n_kv_heads=8', '--config.model.d_model=2048',
                 '--config.model.d_ff=8192', '--config.model.n_layers=2',
                 '--config.model.attention=pallas', '--config.seq_len=2048')
  if result.returncode == 0:
    return survived(result)
  return refused(result, 'config.model')


@case('plan: a batch the mesh does not divide, on H100s not here')
def _(p):
  result = p.run('train.py', '--config=configs/llama.py:1b', '--config.dry_run=True',
                 '--config.plan.target=H100', '--config.plan.devices=8', '--config.mesh.fsdp=8',
                 '--config.batch_size=4')
  return refused(result, 'config.batch_size=4 is not divisible')


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='Cases whose name contains this (or any of '
                      'these, separated by |).')
  parser.add_argument('--keep', default=None, help='Run in this directory and keep it.')
  args = parser.parse_args()
  root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix='meshlm-fault-probe-'))
  root.mkdir(parents=True, exist_ok=True)
  probe, rows = Probe(root), []
  try:
    for name, fn in CASES.items():
      if not any(part in name for part in args.only.split('|')):
        continue
      start = time.perf_counter()
      try:
        verdict, seen = fn(probe)
      except Exception as e:  # the probe's own expectation failed: count it against us
        verdict, seen = 'BAD', f'probe: {type(e).__name__}: {e}'
      rows.append((name, verdict, seen))
      print(f'{verdict:<5} {name:<48} {time.perf_counter() - start:5.1f}s  {seen}', flush=True)
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)
  counts = {v: sum(r[1] == v for r in rows) for v in ('GOOD', 'UGLY', 'BAD')}
  print(f'\n{len(rows)} cases: {counts["GOOD"]} GOOD, {counts["UGLY"]} UGLY, {counts["BAD"]} BAD')
  print(json.dumps({'benchmark': 'fault_probe', 'cases': len(rows), **counts,
                    'not_good': {r[0]: r[1] for r in rows if r[1] != 'GOOD'},
                    'command': ' '.join(['python', 'scripts/fault_probe.py', *sys.argv[1:]])}))
  return 1 if counts['BAD'] or counts['UGLY'] else 0


if __name__ == '__main__':
  sys.exit(main())
