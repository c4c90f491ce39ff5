"""`specserve status`'s replica table: Serve's replica actors joined with each replica's live
load from the ingress's `/health`."""

from cluster.launch.status import format_rows, replica_rows

REPLICAS = [
    {"deployment": "Ingress", "replica": "i1", "node": "10.0.0.1", "pid": 11, "actor_state": "ALIVE"},
    {"deployment": "SmallServer", "replica": "s1", "node": "10.0.0.2", "pid": 12, "actor_state": "ALIVE"},
    {"deployment": "TargetServer", "replica": "t1", "node": "10.0.0.3", "pid": 13, "actor_state": "ALIVE"},
    {"deployment": "TargetServer", "replica": "t2", "node": "10.0.0.4", "pid": 14, "actor_state": "ALIVE"},
    {"deployment": "TargetServer", "replica": "t3", "node": "10.0.0.4", "pid": 15, "actor_state": "DEAD"},
    {"deployment": "TargetServer", "replica": "t4", "node": "10.0.0.3", "pid": 16, "actor_state": "ALIVE"},
]
HEALTH = {"tiers": {
    "target": {"per_replica": {
        "t1": {"running": 3, "waiting": 1, "kv_headroom": 0.25, "available": True,
               "draft": "/drafts/round-002"},
        "t2": {"running": 0, "waiting": 0, "kv_headroom": 1.0, "available": False}}},
    "small": {"per_replica": {"s1": {"running": 1, "waiting": 0, "kv_headroom": 0.9,
                                     "available": True}}}}}


def test_each_replica_gets_its_own_load_and_state():
    rows = {r["replica"]: r for r in replica_rows(REPLICAS, HEALTH)}
    assert {k: rows[k]["state"] for k in rows} == {
        "i1": "serving", "s1": "serving", "t1": "serving", "t2": "restarting", "t3": "DEAD",
        "t4": "starting"}
    assert (rows["t1"]["running"], rows["t1"]["waiting"], rows["t1"]["kv_headroom"]) == (3, 1, 0.25)
    assert rows["s1"]["running"] == 1 and rows["t4"]["running"] is None
    assert rows["t2"]["node"] == "10.0.0.4" and rows["i1"]["running"] is None


def test_without_the_admin_view_replicas_are_only_alive_and_the_table_prints():
    rows = replica_rows(REPLICAS, None)
    assert {r["state"] for r in rows if r["deployment"] == "TargetServer"} == {"alive", "DEAD"}
    lines = format_rows(replica_rows(REPLICAS, HEALTH))
    assert len(lines) == 1 + len(REPLICAS)
    assert "restarting" in lines[4] and "25%" in lines[3] and "10.0.0.3" in lines[3]
    assert lines[3].endswith(" round-002") and lines[4].endswith(" -")   # the draft served
