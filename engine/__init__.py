"""Token-level inference: sequences, KV budgets, the continuous-batching scheduler, speculative
steps, rejection sampling and metrics. Imports torch and `models/`; never Ray or the serving side.

Kept free of imports on purpose: `engine.cost_model` is pure Python and is imported by the policy
and the simulator without pulling torch.
"""

import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a machine whose
# cores are shared (Ray processes, other replicas), spinning threads made a 2-thread decode step
# 6-30x slower (batch 4: 138-583 ms against 19-22 ms sleeping, load average ~11 on 2 cores).
# Only takes effect if torch is not imported yet; OMP_WAIT_POLICY=ACTIVE in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
