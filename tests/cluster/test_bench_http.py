"""`specserve bench http`: the figures of a guidellm window, the interleaved order of windows
and the side-by-side ratios (the median of adjacent pairs, not the ratio of medians)."""

from __future__ import annotations

import argparse
import json
import stat
import sys

import pytest

from cluster.bench import http_peer


def report(tokens_ok: int, tokens_cut: int, seconds: float, ttft_p50: float, errored=0) -> dict:
    """The parts of guidellm 0.8.1's JSON report that the bench reads."""
    return {"benchmarks": [{"duration": seconds, "metrics": {
        "output_token_count": {"successful": {"total_sum": tokens_ok},
                               "incomplete": {"total_sum": tokens_cut}},
        "time_to_first_token_ms": {"successful": {"percentiles": {"p50": ttft_p50}}},
        "request_totals": {"successful": 3, "errored": errored}}}]}


def test_a_window_counts_cut_requests_tokens_over_its_length():
    got = http_peer.window_figures(report(900, 100, 10.0, 25.0, errored=2))
    assert got == {"tok_s": 100.0, "ttft_ms": 25.0, "errors": 2}


def test_ratios_are_the_median_of_adjacent_pairs():
    """Round 3 is a slow machine for both servers: the pairs still read 2.0 each, while the
    ratio of the medians (300 / 100) would read 3.0."""
    w = lambda tok, ttft: {"tok_s": tok, "ttft_ms": ttft, "errors": 0}     # noqa: E731
    windows = {(4, "ours"): [w(400, 10), w(300, 30), w(100, 90)],
               (4, "peer"): [w(200, 20), w(150, 15), w(50, 60)]}
    (row,) = http_peer.summarise(windows, ["ours", "peer"])
    assert row["servers"]["ours"]["tok_s"] == 300 and row["servers"]["peer"]["tok_s"] == 150
    assert row["ratios"]["peer"]["tok_s"] == (2.0, 2.0, 2.0)
    assert row["ratios"]["peer"]["ttft"] == (1.5, 0.5, 2.0)
    text = http_peer.table([row], ["ours", "peer"])
    assert "| 4 | 300.0 (30.0) | 150.0 (20.0) | 2.00 (2.00-2.00) | 1.50 (0.50-2.00) |" in text


@pytest.mark.parametrize("specs", [["a=http://x"], ["a=http://x", "a=http://y"],
                                   ["a=http://x", "b:http://y"], ["a=http://x", "b=ftp://y"]])
def test_bad_server_lists_are_refused(specs):
    with pytest.raises(ValueError, match="--server"):
        http_peer.servers(specs)


def test_windows_alternate_servers_within_each_round(tmp_path, capsys):
    """A stand-in guidellm (the real one is not a dependency) logs the server and streams of
    each window it is asked for, and writes a report whose tokens tell the servers apart."""
    log = tmp_path / "calls.txt"
    tool = tmp_path / "guidellm"
    tool.write_text(f"""#!{sys.executable}
import json, sys
argv = sys.argv[1:]
target = argv[argv.index("--backend") + 1].split("target=")[1].split(",")[0]
streams = argv[argv.index("profile.streams") + 1]
path = argv[argv.index("--output") + 1].split("path=")[1]
open({str(log)!r}, "a").write(f"{{target}} {{streams}}\\n")
tokens = 600 if "ours" in target else 300
json.dump({json.dumps(report(0, 0, 1.0, 0))}, open(path, "w"))
r = json.load(open(path)); b = r["benchmarks"][0]
b["duration"] = 3.0; b["metrics"]["output_token_count"]["successful"]["total_sum"] = tokens
b["metrics"]["time_to_first_token_ms"]["successful"]["percentiles"]["p50"] = tokens / 10
json.dump(r, open(path, "w"))
""")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    parser = argparse.ArgumentParser()
    http_peer.add_arguments(parser)
    args = parser.parse_args(["--server", "ours=http://ours", "--server", "peer=http://peer",
                              "--model", "m", "--tokenizer", "t", "--streams", "1,4",
                              "--rounds", "2", "--guidellm", str(tool),
                              "--out", str(tmp_path / "out")])
    assert http_peer.run(args) == 0
    assert log.read_text().split("\n")[:-1] == [
        "http://ours 1", "http://peer 1", "http://ours 4", "http://peer 4"] * 2
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["streams"] for r in rows] == [1, 4]
    assert rows[0]["ratios"]["peer"]["tok_s"] == [2.0, 2.0, 2.0]
    assert "| 1 | 200.0 (60.0) | 100.0 (30.0) | 2.00 (2.00-2.00) | 2.00 (2.00-2.00) |" in \
        capsys.readouterr().out


def test_a_missing_guidellm_is_one_line_and_exit_1(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    http_peer.add_arguments(parser)
    args = parser.parse_args(["--server", "a=http://a", "--server", "b=http://b", "--model", "m",
                              "--tokenizer", "t", "--guidellm", str(tmp_path / "absent"),
                              "--out", str(tmp_path / "out")])
    assert http_peer.run(args) == 1
    err = capsys.readouterr().err
    assert "absent" in err and "Traceback" not in err
