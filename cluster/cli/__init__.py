"""The one command line: `specserve ...` (also `python -m cluster ...`).

Each subcommand lives in its own module, imported only when it runs, so `specserve --help`
stays fast and a subcommand never pays for another's imports (Ray, torch, matplotlib).
A module registered here exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import engine  # noqa: F401,E402  (chooses how OpenMP threads wait, before torch loads it)

# (command path, module, help). Nested commands are written "group sub".
COMMANDS: list[tuple[str, str, str]] = [
    ("up", "cluster.launch.up", "start a local Ray cluster, deploy the app, print the URLs"),
    ("deploy", "cluster.launch.deploy", "deploy a config to a running Ray cluster"),
    ("status", "cluster.launch.status", "summarise tiers, replicas and load of a running app"),
    ("demo", "cluster.cli.demo", "build the demo family if missing and generate with target and draft"),
    ("models build-demo", "cluster.cli.models_build_demo", "train the demo model family (tokenizer, target, draft, small)"),
    ("models info", "cluster.cli.models_info", "print a checkpoint's parameters, weight bytes and KV bytes per token"),
    ("models plan", "cluster.cli.models_plan", "each GPU tier's memory plan: weights, activations, KV budget"),
    ("bench chat", "cluster.bench.chat", "multi-turn chat over HTTP: prefix caching on vs off, TTFT per turn"),
    ("bench engine", "cluster.bench.engine", "benchmark the engine side by side with transformers"),
    ("bench load", "cluster.bench.load", "per-rank memory of loading a tensor-parallel shard (70B widths by default)"),
    ("bench sampler", "cluster.bench.sampler", "acceptance of the coupled (seeded) sampler next to rejection sampling"),
    ("bench failover", "cluster.bench.failover", "kill the target's engine process under load; time the recovery"),
    ("bench ramp", "cluster.bench.ramp", "a load that rises and falls against autoscaling tiers: replicas per tier over time"),
    ("bench overload", "cluster.bench.overload", "drive a running cluster at 4x its capacity; check nothing is lost"),
    ("bench prefix", "cluster.bench.prefix", "multi-turn chat on one engine: prefix caching off vs on, TTFT per turn"),
    ("bench http", "cluster.bench.http_peer", "a stock load client (guidellm) against running servers, interleaved windows, ratios"),
    ("bench serve", "cluster.bench.serve", "drive a running cluster over HTTP: policies x loads, JSON + PNG"),
    ("simulate", "cluster.sim.simulate", "run the capacity simulator on a scenario"),
    ("keys add", "cluster.cli.keys", "create an API key bound to a pricing plan (live, no restart)"),
    ("keys list", "cluster.cli.keys", "list API keys (ids, names, plans, status; never the keys)"),
    ("keys revoke", "cluster.cli.keys", "revoke an API key (refused within seconds)"),
    ("keys rotate", "cluster.cli.keys", "give a key a new secret; the old one stops working"),
    ("usage", "cluster.cli.usage", "usage and revenue per key, plan, tier and day from the ledger"),
    ("draft distill", "cluster.cli.draft_distill", "distil the draft (or small model) on the target's outputs with DeepSpeed"),
    ("draft swap", "cluster.cli.draft_swap", "swap a distilled draft into the running target replicas"),
    ("draft rollback", "cluster.cli.draft_swap", "return the target replicas to their previous draft"),
    ("draft history", "cluster.cli.draft_loop", "the alignment loop's record: triggers, rounds, canaries, promotions, rollbacks"),
    ("draft canary", "cluster.cli.draft_loop", "canary a draft on live traffic; the alignment loop promotes or rolls it back"),
    ("draft prompts", "cluster.cli.draft_prompts", "write the built-in code/prose/chat prompt set"),
    ("draft bench", "cluster.bench.drafts", "single-stream speculative speed-up per prompt class, drafts side by side"),
]


def _lazy(module: str):
    """Import a subcommand module; a missing one reports cleanly instead of crashing --help."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    wanted = " ".join(a for a in argv if not a.startswith("-"))
    for path, module, help_text in COMMANDS:
        words = path.split()
        target = subparsers
        if len(words) == 2:
            if words[0] not in groups:
                group = subparsers.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
            target = groups[words[0]]
        sub = target.add_parser(words[-1], help=help_text)
        sub.set_defaults(_module=module)
        # Only the chosen command imports its module (to add its arguments).
        if wanted.startswith(path):
            mod = _lazy(module)
            if mod is not None:
                mod.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help()
        return 2
    mod = _lazy(module)
    if mod is None:
        print(f"specserve: '{module}' is not available in this build", file=sys.stderr)
        return 2
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
