"""What keeps a run alive and its files whole: the entry points' handling of bad settings (cli),
the workdir and its lock (workdir), joining a multi-process job (distributed), stopping on a
signal (preemption) and checkpoints (checkpoint). Every process of a job makes the same
collective calls here, in the same order."""
