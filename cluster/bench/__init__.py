"""Benchmarks: the engine beside transformers (`engine.py`), the samplers (`sampler.py`), drafts
per prompt class (`drafts.py`), a served cluster over HTTP (`serve.py`, `client.py`, `stats.py`,
`plot.py`, `local.py`), overload (`overload.py`) and peers (`peer.py`, `peer_vllm.py`)."""
