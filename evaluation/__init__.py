"""After training: lm-eval on a checkpoint (harness.py), and the tasks meshlm ships (tasks/)."""
