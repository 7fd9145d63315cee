"""The training step's memory, applied to a model from outside: the forward, its choices, tiling, recomputation,
losses, log-probs, the logits tail; a DiT's stack."""
