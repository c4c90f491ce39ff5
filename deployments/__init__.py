"""Ray Serve deployments: the wiring from Ray to the engine, the models and the router.

`target.py` (one tensor-parallel group per replica, draft in process; both target tiers),
`small.py` (the small tier), `tp_group.py` (placement-group ranks and their watch),
`engine_server.py` (what every tier replica does), `metrics.py` (Serve metrics) and `app.py`
(`build_app(AppConfig) -> Application`). No tensor math here: the engine runs without Ray.
"""
