"""Train state, the compiled step, the loop, the optimizer and metrics."""
