"""marin's config folders: `experiment/` and `sweep/` options compose at the root (see marin_groups.py)."""
