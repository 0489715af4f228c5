"""Where a run goes: the plan (dry run), in-process training, Slurm submission, meshes."""
