"""What the presets of a checkpoint family (configs/qwen3.py, configs/gemma3.py) share: a preset's
config from its shapes, the family's common settings and its run."""

from configs import base


def preset_config(family: str, preset: str, shapes: dict, common: dict, runs: dict, *,
                  unrolled=(), host_moments=()):
  """configs/<family>.py's get_config(preset): the preset's shapes (`shapes[preset]`) and the
  family's `common` settings; its global batch, seq_len, remat policy and microbatches
  (`runs[preset]`); layers unrolled where `unrolled` names it, Adam's moments in host memory
  where `host_moments` does, the head 1024 tokens at a time (logits of a 150k–262k vocabulary
  never held whole)."""
  if preset not in shapes:
    raise ValueError(f'configs/{family}.py: unknown preset {preset!r}; use one of '
                     f'{sorted(shapes)}, e.g. --config=configs/{family}.py:{sorted(shapes)[-1]}')
  c = base.get_config()
  c.workdir = f'/tmp/meshlm-{family}-{preset}'
  c.train_steps, c.log_every, c.eval_every = 10_000, 10, 1000
  c.batch_size, c.seq_len, c.model.remat_policy, c.microbatches = runs[preset]
  c.model.update(shapes[preset], **common)
  c.model.scan_layers = preset not in unrolled
  c.model.head_chunk = 1024
  if preset in host_moments:
    c.optimizer.mu_tier = c.optimizer.nu_tier = 'host'
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 3e-4, 500
  return c
