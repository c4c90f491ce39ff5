"""Everything around the serving system: the `specserve` CLI (`cli/`), launchers (`launch/`),
benchmarks (`bench/`), the capacity simulator (`sim/`), Serve configs (`configs/`) and the
shipped prompts (`prompts/`). May import anything; nothing imports `cluster/`."""
