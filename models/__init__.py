"""Models: loading local Hugging Face checkpoints, tensor parallelism, the demo family.

Imports torch and transformers; never the engine, Ray or the serving side.
"""

# Temperatures below this are greedy (1 / T would overflow the logits). The engine's samplers
# and the distillation's scoring read it here, the floor they share.
GREEDY_BELOW = 1e-5
