"""Integrations with model libraries (Hugging Face transformers)."""
