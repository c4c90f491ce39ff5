"""The figure and the table of `specserve bench serve` (matplotlib, Agg; imported only here).

Row 1, closed-loop users: the seed article's two panels (output tokens/s vs users, p95
end-to-end latency vs users, one line per policy)
and SLO attainment vs users. Error bars on throughput: the lowest and highest repeat. Row 2, the same against the offered Poisson rate, when measured.
"""

from __future__ import annotations

from pathlib import Path


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    kinds = [k for k in ("users", "rate") if any(r["load_kind"] == k for r in results)]
    fig, axes = plt.subplots(len(kinds), 3, figsize=(15, 4.2 * len(kinds)), squeeze=False)
    slo = report["slo"]
    for row, kind in zip(axes, kinds):
        for policy in dict.fromkeys(r["policy"] for r in results):
            rs = sorted((r for r in results if r["load_kind"] == kind and r["policy"] == policy),
                        key=lambda r: r["load"])
            x = [r["load"] for r in rs]
            y = [r["output_tok_s"] for r in rs]
            reps = [[q["output_tok_s"] for q in report["runs"] if q["policy"] == policy
                     and (q["load_kind"], q["load"]) == (kind, r["load"])] or [v] for r, v in zip(rs, y)]
            spread = [[v - min(q) for v, q in zip(y, reps)], [max(q) - v for v, q in zip(y, reps)]]
            row[0].errorbar(x, y, yerr=spread, marker="o", capsize=3, label=policy)
            row[1].plot(x, [r["e2e_s"]["p95"] for r in rs], marker="o", label=policy)
            row[2].plot(x, [100 * (r["slo_attainment"] or 0) for r in rs], marker="o", label=policy)
        xlabel = "concurrent users (closed loop)" if kind == "users" else "offered rate, requests/s (Poisson)"
        titles = ("output tokens/s", "p95 end-to-end latency (s)",
                  f"SLO attainment % (TTFT <= {slo['ttft_s']:g} s, TPOT <= {1000 * slo['tpot_s']:g} ms)")
        for ax, title in zip(row, titles):
            ax.set_xlabel(xlabel)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if kind == "users":
                ax.set_xscale("log", base=2)
        row[0].legend()
    fig.suptitle(f"specserve bench serve: {report['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mb(value) -> str:
    return f"{value / 2**20:.1f}" if value else "-"


def table(report: dict) -> str:
    head = (f"{'load':>9} {'policy':>15} {'tok/s':>13} {'req/s':>6} {'e2e p50':>8} {'p95':>7} "
            f"{'p99':>7} {'TTFT95':>7} {'TPOT50':>7} {'SLO%':>5} {'good/s':>7} {'acc':>5} "
            f"{'KVt/d MB':>11}  tiers / errors")
    lines = [head]
    for r in report["results"]:
        ci = r["repeats"]["output_tok_s"]["ci95"]
        tok = f"{r['output_tok_s']:.1f}" + (f"+-{ci:.1f}" if ci else "")
        e2e, ttft, tpot = r["e2e_s"], r["ttft_s"], r["tpot_s"]
        fmt = lambda v, s=1: f"{v * s:.2f}" if v is not None else "-"   # noqa: E731
        kv = r["health_peaks"].get("target", {})
        tiers = ",".join(f"{t}:{100 * s:.0f}%" for t, s in r["tier_shares"].items())
        errs = " ".join(f"{s}x{n}" for s, n in r["errors_by_status"].items())
        load = f"{'u' if r['load_kind'] == 'users' else 'rps'}={r['load']:g}"
        lines.append(f"{load:>9} {r['policy']:>15} {tok:>13} {r['requests_per_s']:>6.2f} "
                     f"{fmt(e2e['p50']):>8} {fmt(e2e['p95']):>7} {fmt(e2e['p99']):>7} "
                     f"{fmt(ttft['p95']):>7} {fmt(tpot['p50'], 1000):>7} "
                     f"{100 * (r['slo_attainment'] or 0):>5.0f} {r['goodput_tok_s']:>7.1f} "
                     f"{fmt(r['acceptance_rate']):>5} "
                     f"{_mb(kv.get('peak_kv_used_target_bytes')) + '/' + _mb(kv.get('peak_kv_used_draft_bytes')):>11}"
                     f"  {tiers} {errs}")
    lines.append("\nauto against the best fixed policy (standard, premium, always-adaptive):")
    for c in report["comparison"]:
        p95 = f"{c['p95_ratio']:.3f}" if c["p95_ratio"] else "-"
        lines.append(f"  {c['load_kind']}={c['load']:g}: best {c['best_fixed']:>15}  "
                     f"throughput {c['throughput_ratio']:.3f}x  p95 {p95}x")
    for run in report.get("runs", []):
        if run.get("timeline"):
            lines += [f"\ntimeline of {run['policy']} at {run['load_kind']}={run['load']:g} "
                      f"#{run['repeat'] + 1} (requests finished per bucket; acceptance, TPOT p50 ms):"]
            for row in run["timeline"]:
                cells = "  ".join(f"{c}: {v['requests']} {_fmt(v['acceptance_rate'])} "
                                  f"{_fmt(v['tpot_p50_s'], 1000, 0)}" for c, v in row["classes"].items())
                lines.append(f"  t={row['t0_s']:>7.1f}s  failed {row['failed']}  {cells}")
    return "\n".join(lines)


def _fmt(v, scale=1.0, digits=3) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def plot_timeline(report: dict, path: Path) -> Path:
    """Each run with a timeline: per prompt class, the acceptance of its speculative requests
    and its output tokens a second, bucket by bucket; the alignment loop's records (trigger,
    round, canary, promote, rollback) as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report["runs"] if r.get("timeline")]
    fig, axes = plt.subplots(len(runs), 2, figsize=(15, 4.2 * len(runs)), squeeze=False)
    events = report.get("alignment_history", [])
    for row, run in zip(axes, runs):
        buckets = run["timeline"]
        width = (buckets[1]["t0_s"] - buckets[0]["t0_s"]) if len(buckets) > 1 else 1.0
        for cls in sorted({c for b in buckets for c in b["classes"]}):
            x = [b["t0_s"] + width / 2 for b in buckets if cls in b["classes"]]
            acc = [b["classes"][cls]["acceptance_rate"] for b in buckets if cls in b["classes"]]
            tok = [b["classes"][cls].get("tokens", 0) / width for b in buckets if cls in b["classes"]]
            row[0].plot(x, [float("nan") if a is None else a for a in acc], marker=".", label=cls)
            row[1].plot(x, tok, marker=".", label=cls)
        for rec in events:
            t = rec["time"] - run["start_unix"]
            if buckets[0]["t0_s"] <= t <= buckets[-1]["t0_s"] + width:
                for ax in row:
                    ax.axvline(t, color="grey", lw=0.8, ls="--")
                row[0].annotate(f"{rec['event']} {rec.get('reason', '')}".strip(), (t, 0.02),
                                rotation=90, fontsize=7, va="bottom")
        row[0].set_ylim(0, 1)
        for ax, title in zip(row, ("acceptance of speculative requests", "output tokens/s")):
            ax.set_xlabel(f"seconds into the run ({run['policy']} at {run['load_kind']}="
                          f"{run['load']:g})")
            ax.set_title(f"{title}, by prompt class")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
