"""Plans before a run: the compiled step's memory, FLOPs and collectives (plan), the mesh × remat ×
microbatch search (layout), model FLOPs and MFU (flops), the GPUs meshlm knows (gpus) and
compiling for them without one (gpu_compiler)."""
