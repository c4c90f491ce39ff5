"""`specserve bench http`: a stock load client (guidellm) against two or more running
OpenAI-compatible servers, in interleaved windows, with the ratios printed side by side.

For each round and each stream count, one window per server, one after the other (the
servers' order as given): on a machine whose speed drifts, adjacent windows see the same
machine. A cell is the median of its rounds; a ratio is the median of the adjacent windows'
ratios (the first server against each other), with their range. Tokens a second are the
output tokens of complete and cut requests over the window, as guidellm counts them.

guidellm runs as a child process from its own environment (`--guidellm`), never a dependency
of this project: `python3 -m venv gl-venv && gl-venv/bin/pip install torch==2.13.0
guidellm==0.8.1`. Its results stay under `--out`, one JSON per window.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--server", action="append", required=True, metavar="NAME=URL",
                   help="a server to drive (at least two; the first is the one compared)")
    p.add_argument("--model", required=True, help="the model name both servers answer to")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder for guidellm's prompts")
    p.add_argument("--streams", default="1,4,16", help="concurrent streams, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="windows per server and stream count")
    p.add_argument("--seconds", type=float, default=30.0, help="one window's length")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    p.add_argument("--out", default="bench-http", help="folder for each window's JSON")


def servers(specs: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--server takes NAME=URL (http://...), not {spec!r}")
        pairs.append((name, url.rstrip("/")))
    if len(pairs) < 2 or len({n for n, _ in pairs}) != len(pairs):
        raise ValueError("--server: give at least two servers with distinct names")
    return pairs


def window_figures(report: dict) -> dict:
    """(tok/s, TTFT p50 ms, errored requests) of one guidellm JSON report."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    counts = m["output_token_count"]
    tokens = sum(counts[k]["total_sum"] for k in ("successful", "incomplete") if counts.get(k))
    return {"tok_s": tokens / bench["duration"],
            "ttft_ms": m["time_to_first_token_ms"]["successful"]["percentiles"]["p50"],
            "errors": m["request_totals"].get("errored", 0)}


def summarise(windows: dict, names: list[str]) -> list[dict]:
    """windows[(streams, name)] = [figures per round, in round order] -> one row per stream
    count: medians per server, and each other server's pair ratios (first / other)."""
    rows = []
    for streams in sorted({s for s, _ in windows}):
        row = {"streams": streams, "servers": {}, "ratios": {}}
        for name in names:
            got = windows[(streams, name)]
            row["servers"][name] = {
                "tok_s": statistics.median(w["tok_s"] for w in got),
                "ttft_ms": statistics.median(w["ttft_ms"] for w in got),
                "errors": sum(w["errors"] for w in got)}
        first = windows[(streams, names[0])]
        for name in names[1:]:
            pairs = list(zip(first, windows[(streams, name)]))
            tok = [a["tok_s"] / b["tok_s"] for a, b in pairs]
            ttft = [a["ttft_ms"] / b["ttft_ms"] for a, b in pairs]
            row["ratios"][name] = {"tok_s": (statistics.median(tok), min(tok), max(tok)),
                                   "ttft": (statistics.median(ttft), min(ttft), max(ttft))}
        rows.append(row)
    return rows


def table(rows: list[dict], names: list[str]) -> str:
    head = names[0]
    lines = [f"| streams | {' | '.join(f'{n} tok/s (TTFT p50 ms)' for n in names)} | "
             + " | ".join(f"{head}/{n} tok/s (range) | TTFT (range)" for n in names[1:]) + " |",
             "|" + "---|" * (1 + len(names) + 2 * (len(names) - 1))]
    for row in rows:
        cells = [f"{row['servers'][n]['tok_s']:.1f} ({row['servers'][n]['ttft_ms']:.1f})"
                 for n in names]
        for n in names[1:]:
            for key in ("tok_s", "ttft"):
                mid, lo, hi = row["ratios"][n][key]
                cells.append(f"{mid:.2f} ({lo:.2f}-{hi:.2f})")
        lines.append(f"| {row['streams']} | " + " | ".join(cells) + " |")
    errors = {n: sum(r["servers"][n]["errors"] for r in rows) for n in names}
    return "\n".join(lines) + f"\nerrored requests: {errors}"


def _window(args, url: str, streams: int, path: Path) -> dict:
    cmd = [args.guidellm, "run", "--backend",
           f"kind=openai_http,target={url},model={args.model},request_format=/v1/completions",
           "--profile", "kind=concurrent,streams=1", "--override", "profile.streams", str(streams),
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                     f"output_tokens={args.output_tokens}",
           "--constraint", f"kind=max_duration,seconds={args.seconds:g}",
           "--tokenizer", f"kind=hf_auto,model={args.tokenizer}",
           "--output", f"kind=json,path={path}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not path.exists():
        raise RuntimeError(f"guidellm failed ({done.returncode}): {done.stderr[-1500:]}")
    return window_figures(json.loads(path.read_text()))


def run(args) -> int:
    try:
        pairs = servers(args.server)
        counts = [int(s) for s in args.streams.split(",")]
    except ValueError as exc:
        print(f"specserve bench http: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    windows: dict = {}
    for rnd in range(args.rounds):
        for streams in counts:
            for name, url in pairs:
                try:
                    got = _window(args, url, streams, out / f"{name}-s{streams}-r{rnd + 1}.json")
                except (OSError, RuntimeError) as exc:     # no guidellm, or a window failed
                    print(f"specserve bench http: {name} at {streams} streams: {exc}",
                          file=sys.stderr)
                    return 1
                windows.setdefault((streams, name), []).append(got)
                print(f"round {rnd + 1} streams {streams:3d} {name:12s} {got['tok_s']:8.1f} tok/s"
                      f"  TTFT p50 {got['ttft_ms']:7.1f} ms  errors {got['errors']}", flush=True)
    names = [n for n, _ in pairs]
    rows = summarise(windows, names)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(table(rows, names))
    return 0
