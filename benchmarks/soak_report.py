"""The soak test's report (benchmarks/soak.py): outcomes, latencies side by side (flood on/off,
push/no push), the store check (every acknowledged record and feedback present) and resources."""

from __future__ import annotations

import statistics
import time

from benchmarks.soak_traffic import Stats


def _q(values: list[float]) -> dict:
    if len(values) < 2:
        return {"n": len(values)}
    q = statistics.quantiles(values, n=100)
    return {"n": len(values), "p50_s": round(q[49], 3), "p99_s": round(q[98], 3)}


def _inside(rec: tuple, windows: list[tuple[float, float]]) -> bool:
    return any(w0 <= rec[0] and rec[1] <= w1 for w0, w1 in windows)


def _overlaps(rec: tuple, windows: list[tuple]) -> bool:
    return any(rec[0] < w[1] and w[0] < rec[1] for w in windows)


def _ratio(a: dict, b: dict) -> float | None:
    return round(a["p99_s"] / b["p99_s"], 3) if "p99_s" in a and "p99_s" in b else None


def server_counters(metrics_text: str) -> dict:
    """The server's own counts of KV-cache refusals, dropped/withheld records, deadlines."""
    wanted = ("dlrl_kv_cache_refusals_total", "dlrl_records_dropped_total", "dlrl_record_ids_withheld_total",
              "dlrl_request_success_total{finished_reason=\"abort\"", "dlrl_store_errors_total", "dlrl_records_total")
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(wanted) and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def check_store(url: str, stats: Stats) -> dict:
    """Every acknowledged record id must be in the store, every feedback answered 200 with its reward."""
    import psycopg

    with psycopg.connect(url) as conn:
        ids = {r[0] for r in conn.execute("SELECT id FROM dlrl_records")}
        feedback = dict(conn.execute("SELECT record_id, reward FROM dlrl_feedback").fetchall())
    lost = sorted(stats.acked - ids)
    lost_fb = sorted(rid for rid in stats.feedback_acked if rid not in feedback)
    wrong_fb = sorted(rid for rid, r in stats.feedback_acked.items() if rid in feedback and feedback[rid] != r)
    return {"records_acknowledged": len(stats.acked), "records_in_store": len(ids),
            "samples_answered_record_id_null": stats.null_ids,
            "lost_acknowledged_records": len(lost), "lost_examples": lost[:5],
            "feedback_acknowledged": len(stats.feedback_acked), "feedback_in_store": len(feedback),
            "lost_acknowledged_feedback": len(lost_fb), "feedback_with_wrong_reward": len(wrong_fb),
            "feedback_outcomes": stats.feedback_outcomes}


def _outcomes(stats: Stats) -> dict:
    out: dict[str, dict[str, int]] = {}
    for _, _, cls, _, outcome in stats.records:
        key = outcome.split(" ")[0]
        if key.startswith("error:"):
            key = "error"
        out.setdefault(cls, {})
        out[cls][key] = out[cls].get(key, 0) + 1
    return out


def report(stats: Stats, t_start: float, warmup_end: float, end_rss: int, health: dict,
           exit_code: int | None, store: dict, counters: dict) -> dict:
    fivexx = [r[4] for r in stats.records if r[4].startswith(("5xx:", "stream_5xx:"))]
    errors = [r[4] for r in stats.records if r[4].startswith("error:")]
    normal = [r for r in stats.records if r[2] == "normal" and r[4] == "200" and r[0] >= warmup_end
              and not _overlaps(r, stats.pg_down)]
    quiet = [(w1, t_start + 10**9) for _, w1 in stats.flood_windows[-1:]]  # after the last flood window
    quiet += [(a[1], b[0]) for a, b in zip(stats.flood_windows, stats.flood_windows[1:])]
    quiet += [(t_start, stats.flood_windows[0][0])] if stats.flood_windows else [(t_start, t_start + 10**9)]
    calm = [r for r in normal if not _overlaps(r, stats.pushes)]  # the flood's effect alone
    flood_lat = _q([r[1] - r[0] for r in calm if _inside(r, stats.flood_windows)])
    quiet_lat = _q([r[1] - r[0] for r in calm if _inside(r, quiet)])
    flood_all = _q([r[1] - r[0] for r in normal if _inside(r, stats.flood_windows)])
    quiet_all = _q([r[1] - r[0] for r in normal if _inside(r, quiet)])
    flood_s = sum(w1 - w0 for w0, w1 in stats.flood_windows)
    flood_reqs = [r for r in stats.records if r[2] == "flood"]
    done = [r for r in stats.records if r[2] == "normal" and r[4] == "200"]
    warm = [rss for t, rss in stats.rss if t >= warmup_end]
    start_rss = warm[0] if warm else end_rss
    used, total = health.get("num_kv_pages_used"), health.get("num_kv_pages_total")
    return {
        "duration_s": round(time.monotonic() - t_start, 1), "requests": len(stats.records),
        "outcomes_by_client": _outcomes(stats),
        "5xx": len(fivexx), "5xx_examples": sorted(set(fivexx))[:5],
        "transport_or_stream_errors": len(errors), "error_examples": sorted(set(errors))[:5],
        "flood": {"seconds": round(flood_s, 1), "requests": len(flood_reqs),
                  "requests_per_s": round(len(flood_reqs) / max(flood_s, 1e-9), 1)},
        "normal_keys_latency_flood_on": flood_lat, "normal_keys_latency_flood_off": quiet_lat,
        "normal_keys_p99_ratio_flood_on_over_off": _ratio(flood_lat, quiet_lat),
        "normal_keys_latency_flood_on_incl_pushes": flood_all, "normal_keys_latency_flood_off_incl_pushes": quiet_all,
        "normal_keys_p99_ratio_incl_pushes": _ratio(flood_all, quiet_all),
        "normal_latency_with_push": _q([r[1] - r[0] for r in done if _overlaps(r, stats.pushes)]),
        "normal_latency_without_push": _q([r[1] - r[0] for r in done if not _overlaps(r, stats.pushes)]),
        "long_latency": _q([r[1] - r[0] for r in stats.records if r[2] == "long" and r[4] == "200"]),
        "pushes": len(stats.pushes), "push_errors": stats.push_errors[:5],
        "push_seconds": _q([p[1] - p[0] for p in stats.pushes]),
        "postgres_down_s": [round(b - a, 1) for a, b in stats.pg_down],
        "store": store, "server_counters": counters,
        "rss_after_warmup_mb": round(start_rss / 2**20, 1), "rss_end_mb": round(end_rss / 2**20, 1),
        "rss_growth_pct": round(100 * (end_rss - start_rss) / max(start_rss, 1), 1),
        "rss_mb_per_minute": [round(rss / 2**20) for t, rss in stats.rss if int(t - t_start) % 60 < 5],
        "rss_max_mb": round(max((r for _, r in stats.rss), default=end_rss) / 2**20, 1),
        "kv_slots_free_end": f"{health.get('num_free_slots')}/{health.get('max_batch')}",
        "kv_pages_free_end": f"{total - used}/{total}" if used is not None and total is not None else None,
        "running_end": health.get("num_running"), "waiting_end": health.get("num_waiting"),
        "server_exit_code_after_sigterm": exit_code,
    }
