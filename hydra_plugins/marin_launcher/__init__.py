"""marin's Hydra launcher: one Slurm job array per multirun (see marin_launcher.py)."""
