"""Llama-family decoder, KV cache, checkpoint loaders and tokenizer."""
