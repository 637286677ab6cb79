"""Llama-family model with paged attention, and loaders for HF folders and GGUF files."""
