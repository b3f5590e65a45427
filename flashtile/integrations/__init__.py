"""Integrations with other libraries.  Each submodule imports its library lazily (on import of
the submodule), so ``import flashtile`` never needs them:

- ``flashtile.integrations.transformers``: Hugging Face ``attn_implementation`` backend.
"""
