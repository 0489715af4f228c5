"""marin's site folder on Hydra's search path ($MARIN_SITE; see marin_site.py)."""
