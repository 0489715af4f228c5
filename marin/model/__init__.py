"""The Mochi-style MoE transformer. Submodules that need JAX import it themselves, so that
`marin.model.accounting` stays importable on the config path without JAX."""
