"""Config schemas, derivation and validation. Never imports JAX."""
