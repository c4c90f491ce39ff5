"""Launchers: a local Ray cluster (`ray_local.py`), `specserve up` (`up.py`), `specserve deploy`
(`deploy.py`, a Serve config to a running cluster) and `specserve status` (`status.py`)."""
