"""Data mixtures: schema checks, tokenizers, the preparation cache and the step → batch function."""
