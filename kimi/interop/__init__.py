"""Exchange with other frameworks' definitions of the same models (Hugging Face transformers' Kimi Linear)."""
