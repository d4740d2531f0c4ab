"""Export: trained adapters and bases in the formats other stacks load.

`moetune.export.mlx` converts between transformers/peft and mlx-lm (bases, adapters both
ways, fused models back into transformers' layout) and checks that mlx-lm serves what peft
trained. Heavy libraries load only inside the converters.
"""
