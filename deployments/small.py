"""The small tier replica: the engine in baseline mode on the small model, its own deployment.

Its outputs differ from the target's (a priced quality trade, not a speed trick). No draft, no
tensor parallelism. Deployment options are set in `deployments/app.py`.
"""

from __future__ import annotations

import contextlib

from ray import serve

from deployments.engine_server import EngineServer
from router.wire import GenerateRequest


class SmallServer(EngineServer):
    kind = "small"

    async def generate(self, req: GenerateRequest):
        req.mode, req.k_max = "baseline", 0       # never speculative on the small tier
        # closed here, not when collected: a client that goes away frees the KV at once
        async with contextlib.aclosing(super().generate(req)) as stream:
            async for chunk in stream:
                yield chunk


SmallDeployment = serve.deployment(SmallServer, name="SmallServer")
