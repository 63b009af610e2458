"""Llama-family decoder (the training forward), checkpoint loaders and tokenizer."""
