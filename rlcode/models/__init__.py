"""The policy model: transformer, attention and MLP variants, log-probs from hidden states."""
