"""Trainer-side scoring for on-policy RL: serving-bit logprobs with gradients, the parity gate, TRL."""
