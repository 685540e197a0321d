"""Plans before a run: what it compiles for (target), the compiled step's memory, FLOPs and
collectives (plan), its predicted time (timing), model FLOPs and MFU (flops), the ideal bytes of
a step (communication), the GPUs meshlm knows (gpus) and compiling for them without one
(gpu_compiler)."""
