"""embedlens: inspect the embedding table, the LM head and the logit lens of causal LMs."""

__version__ = "0.1.0"
