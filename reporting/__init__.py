"""What a run reports: metrics.jsonl, TensorBoard events and the console (metrics), profiler traces
(profiling)."""
