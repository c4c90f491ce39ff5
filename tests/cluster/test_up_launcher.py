"""`specserve up` checks its launcher section before it starts anything (no Ray here: a test
module with a cluster of its own would make `ray.is_initialized()` say nothing)."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize("launcher,named", [
    ({"http_port": 8555, "direct_ingress": True, "proxy_port": "eight"}, "proxy_port"),
    ({"http_port": 8555, "direct_ingress": True, "proxy_port": -1}, "proxy_port"),
    ({"http_port": 70000}, "http_port"),
    ({"http_port": True}, "http_port"),
    ({"http_port": 8555, "direct_ingress": True, "proxy_port": 8555}, "proxy_port"),
    ({"http_port": 8555, "direct_ingress": "yes"}, "direct_ingress"),
    ({"http_port": 8555, "direct_ingress_port": 8556}, "direct_ingress_port"),
    ({"http_port": 8555, "direct_ingress": True}, "ingress_num_replicas"),
])
def test_up_refuses_a_bad_launcher_before_starting_ray(tiny_family, tmp_path, launcher, named,
                                                       capsys):
    """A typo in the launcher section is the user's error (exit 2, one line that names the
    key), never a traceback and never a cluster started half-way. Direct ingress binds one port
    per node, so two ingress replicas cannot share it."""
    import argparse

    import ray
    import yaml

    from cluster.launch import up

    path = tmp_path / "up.yaml"
    path.write_text(yaml.safe_dump({
        "launcher": launcher, "app": {"model_name": "tiny", "ingress_num_replicas": 2,
                                      "target": {"model": str(tiny_family["target"])}}}))
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    assert up.run(parser.parse_args(["--config", str(path)])) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not ray.is_initialized()


def test_the_api_port_is_the_ingress_replicas_when_direct_ingress_is_on(tmp_path):
    """`http_port` is where clients connect. With direct ingress the ingress replica binds it
    and Serve's proxy moves to `proxy_port`; `--port` moves the API, not the proxy."""
    import argparse

    import yaml

    from cluster.launch import up

    path = tmp_path / "up.yaml"
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    path.write_text(yaml.safe_dump({"launcher": {"http_port": 8600, "direct_ingress": True,
                                                 "proxy_port": 8602}}))
    got = up._launcher(str(path), parser.parse_args(["--config", str(path)]))
    assert (got["direct_ingress_port"], got["http_port"]) == (8600, 8602)
    got = up._launcher(str(path), parser.parse_args(["--config", str(path), "--port", "9100"]))
    assert (got["direct_ingress_port"], got["http_port"]) == (9100, 8602)
    path.write_text(yaml.safe_dump({"launcher": {"http_port": 8600}}))
    got = up._launcher(str(path), parser.parse_args(["--config", str(path), "--port", "9100"]))
    assert (got["direct_ingress_port"], got["http_port"]) == (None, 9100)


def test_a_port_a_stopped_server_just_closed_is_free_to_serve_on():
    """`specserve up` right after a stop: the old server's closed connections linger on the
    port in TIME_WAIT for a minute, and a server that sets SO_REUSEADDR (uvicorn, Serve's
    ingress) binds it at once; so does the launcher's check, while a port that something
    listens on stays refused."""
    import socket

    from cluster.launch.up import _port_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    assert not _port_free("127.0.0.1", port)        # listening: in use
    conn.close()                                     # the server's side closes first: TIME_WAIT
    client.close()
    server.close()
    assert _port_free("127.0.0.1", port)


@pytest.mark.parametrize("error,calls", [
    ("The current node timed out during startup. This could happen because ...", 2),
    ("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_1d65", 2),
    ("some other failure", 1),
])
def test_a_ray_start_that_times_out_is_tried_once_more(monkeypatch, tmp_path, error, calls):
    """Ray gives its processes a fixed 30 s to come up, which a loaded machine (two test
    workers starting clusters at once) can miss. `start` tries once more on that error, not
    on others; here both tries fail, so the error still reaches the caller."""
    import ray

    from cluster.launch import ray_local

    tried = []

    def init(**options):
        tried.append(options)
        raise Exception(error)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(os, "environ", os.environ.copy())    # what start sets goes after
    monkeypatch.setattr(ray_local, "_saved_env", {})
    with pytest.raises(Exception, match=error[:20]):
        ray_local.start(num_cpus=1, dashboard=False, token_path=tmp_path / "token")
    assert len(tried) == calls and tried[0]["address"] == "local"
