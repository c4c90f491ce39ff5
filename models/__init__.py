"""Models: loading local Hugging Face checkpoints, tensor parallelism, the demo family.

Imports torch and transformers; never the engine, Ray or the serving side.
"""
