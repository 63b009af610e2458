"""Host-side sample stream between generation and training."""
