"""Research benches on moetune's tiny builder, trained from scratch on generated text.

GM-1 (`moetune bench gm1`): a dense model against top-1 / top-2 MoEs with matched active
parameters per token (and an MoE with matched total parameters), same corpus, same token
budget, several seeds; held-out cross-entropy with confidence intervals and routing health.
"""
