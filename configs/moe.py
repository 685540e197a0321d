"""Mixture-of-experts presets (docs/moe.md). tiny: the default run's model with each MLP made 8
SwiGLU experts of half its width, 2 a token, so it has the dense model's active parameters and
3.5× its MLP parameters. On a CPU its experts multiply through XLA's ragged_dot: our kernel's
interpret mode, which the tests run, is too slow for a run; on GPUs set expert_matmul=pallas.

Run:
  python train.py --config=configs/moe.py:tiny --config.workdir=/tmp/meshlm-moe-tiny
Should reach: a loss falling as the default run's does (configs/default.py), with the
load-balancing loss (moe_load_balance in metrics.jsonl) near 1 and each expert's share
(moe_tokens_per_expert/*) near 1/8. Measured on a 2-core CPU: 2.8 s a step (about 9 minutes for
the 200), loss 2.57 at step 20.
"""

from configs import default

PRESETS = {
    # name: config.model's MoE fields on top of the default run's
    'tiny': dict(experts=8, experts_per_token=2, expert_d_ff=384, expert_matmul='ragged_dot'),
}


def get_config(preset: str = 'tiny'):
  if preset not in PRESETS:
    raise ValueError(f'configs/moe.py: unknown preset {preset!r}; use one of {sorted(PRESETS)}, '
                     'e.g. --config=configs/moe.py:tiny')
  c = default.get_config()
  c.workdir = f'/tmp/meshlm-moe-{preset}'
  c.model.update(PRESETS[preset])
  return c
