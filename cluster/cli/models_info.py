"""`specserve models info PATH`: what a checkpoint costs to serve, read from the folder."""

from __future__ import annotations

import json


def add_arguments(p) -> None:
    p.add_argument("path", nargs="+", help="local Hugging Face model folder(s)")
    p.add_argument("--dtype", default="float32")


def run(args) -> int:
    from models.loader import ModelLoadError, load_model

    for path in args.path:
        try:
            print(json.dumps(load_model(path, args.dtype).summary(), indent=1))
        except ModelLoadError as exc:
            print(f"specserve: {exc}")
            return 1
    return 0
