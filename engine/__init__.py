"""Token-level inference: sequences, KV budgets, the continuous-batching scheduler, speculative
steps, rejection sampling and metrics. Imports torch and `models/`; never Ray or the serving side.

Kept free of imports on purpose: `engine.cost_model` is pure Python and is imported by the policy
and the simulator without pulling torch.
"""
