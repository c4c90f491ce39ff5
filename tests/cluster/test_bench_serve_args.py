"""`specserve bench serve` reads its workload flags before it starts anything: a malformed
`--mix`, `--shift` or `--policies` is one line on stderr naming the flag and exit 2, never a
traceback after a cluster was started."""

from __future__ import annotations

import argparse

import pytest

from cluster.bench import serve


def _args(*flags: str):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_the_workload_flags_parse():
    policies, mix, shift = serve.read_workload(_args("--policies", "standard,auto", "--mix",
                                                "code=2,chat=1", "--shift", "300:random=1"))
    assert policies == ["standard", "auto"]
    assert mix == {"code": 2.0, "chat": 1.0}
    assert shift == (300.0, {"random": 1.0})


@pytest.mark.parametrize("flags,named", [
    (("--shift", "300"), "--shift"),
    (("--shift", "soon:code=1"), "--shift"),
    (("--shift=-5:code=1",), "--shift"),
    (("--shift", "300:code"), "--shift"),
    (("--mix", "code=lots"), "--mix"),
    (("--mix", "code=0"), "--mix"),
    (("--mix", "=1"), "--mix"),
    (("--policies", "fastest"), "unknown policies"),
])
def test_a_malformed_flag_is_refused_before_anything_starts(tmp_path, capsys, flags, named):
    missing = tmp_path / "no-family"         # would fail loudly if a cluster were started
    args = _args("--start-local", str(missing), "--out", str(tmp_path / "out"), *flags)
    assert serve.run(args) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "out.json").exists()
