"""What a patch installs and `restore()` undoes: the engine (`patch_model`, `PatchHandle`), the self-check that
keeps only patches agreeing with the original modules, gradient checkpointing, per-layer CUDA graphs and the
garbage-collector freeze."""
