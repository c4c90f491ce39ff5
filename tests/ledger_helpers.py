"""A ledger record for tests."""

from router.ledger import LedgerRecord


def make_record(i: int, **kw) -> LedgerRecord:
    base = dict(request_id=f"req-{i}", key_id="key_abc", key_name="alice", plan="auto",
                endpoint="auto", api="completions", tier="speculative", reason="speculation_pays",
                mode="speculative", speculation_dropped=False, status="ok", http_status=200,
                prompt_tokens=5 + i, completion_tokens=8, speculative_tokens=6, draft_tokens=12,
                accepted_tokens=7, price_micro_usd=100 + i, reserved_tokens=None,
                started_at=1_700_000_000.0 + i, finished_at=1_700_000_001.0 + i)
    base.update(kw)
    return LedgerRecord(**base)
