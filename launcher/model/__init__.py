"""The model: one transformer class for the Llama and GPT-2 families (see transformer.py)."""

from launcher.model.transformer import Transformer

__all__ = ["Transformer"]
