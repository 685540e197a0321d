"""meshlm's entry point: flags → config → run.

  python train.py --config=configs/default.py --config.workdir=/tmp/meshlm-default
  python train.py --config=configs/llama.py:1b --config.mesh.fsdp=8
"""

import os

from absl import app
from ml_collections import config_flags

from runtime import cli

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs', 'default.py')
_CONFIG = config_flags.DEFINE_config_file('config', _DEFAULT,
                                          'Config file, optionally with :variant.', lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  config = _CONFIG.value
  # ml_collections reports a config file it could not load at the config's first use: used
  # here, its mistakes are reported before jax, flax and the data stack are imported (1.5 s).
  config.keys()
  from configs import fields
  fields.checked(config)  # each setting's name and value, before jax, flax and the data stack load
  if config.dry_run:  # plans, and trains nothing
    from evaluation import during
    from training import dry_run
    dry_run.plan(config, tasks=during.TaskScores)
  else:
    from training import settings
    run = settings.resolve(config)  # every setting checked before lm-eval and the data stack load
    from evaluation import during
    from training import loop
    loop.train(run, tasks=during.TaskScores)


if __name__ == '__main__':
  cli.run(main)
