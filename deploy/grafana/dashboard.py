#!/usr/bin/env python3
"""Writes baton's Grafana dashboard (issue 21.4) to deploy/helm/baton/files/baton-dashboard.json.

The panels are listed once below as (title, unit, [(PromQL, legend)]); the JSON is Grafana's dashboard model
(schemaVersion 39, timeseries panels, a Prometheus data source variable and a namespace variable). Request metrics
are read from the router (component="router") so that nothing is counted twice; node metrics carry `pod`.
`tests/integration/test_helm_chart.py` checks that the committed file is what this script writes and that every metric
it names is exported by a live local cluster.

    python3 deploy/grafana/dashboard.py          # rewrite the file
    python3 deploy/grafana/dashboard.py --check  # exit 1 when the file differs
"""
from __future__ import annotations

import json
import pathlib
import sys

OUT = pathlib.Path(__file__).resolve().parents[1] / "helm" / "baton" / "files" / "baton-dashboard.json"

NS = 'namespace=~"$namespace"'
R = f'component="router",{NS}'
W = "$__rate_interval"


def quantiles(metric: str, sel: str) -> list:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}[{W}])))", f"p{int(q * 100)}")
            for q in (0.5, 0.9, 0.99)]


# (row title, [(panel title, unit, [(expr, legend)])])
ROWS = [
    ("Latency (router, as clients see it)", [
        ("Time to first token", "s", quantiles("baton_time_to_first_token_seconds", R)),
        ("Time per output token", "s", quantiles("baton_time_per_output_token_seconds", R)),
        ("End-to-end request latency", "s", quantiles("baton_e2e_request_latency_seconds", R)),
    ]),
    ("Throughput and queue", [
        ("Tokens per second", "short", [
            (f"sum(rate(baton_generation_tokens_total{{{R}}}[{W}]))", "generated"),
            (f"sum(rate(baton_prompt_tokens_total{{{R}}}[{W}]))", "prompt"),
        ]),
        ("Requests per second by status", "reqps", [
            (f"sum by (status) (rate(baton_requests_total{{{R}}}[{W}]))", "{{status}}"),
        ]),
        ("Queue", "short", [
            (f'sum by (pod) (baton_waiting_requests{{component=~"prefill|decode",{NS}}})', "waiting {{pod}}"),
            (f"histogram_quantile(0.9, sum by (le) (rate(baton_queue_time_seconds_bucket{{{NS}}}[{W}])))",
             "p90 queue time (s)"),
        ]),
    ]),
    ("KV cache", [
        ("KV blocks used", "percentunit", [
            (f"baton_kv_blocks_used{{{NS}}} / baton_kv_blocks_capacity{{{NS}}}", "{{pod}}"),
        ]),
        ("Prefix cache hit rate", "percentunit", [
            (f"sum by (pod) (rate(baton_prefix_cache_hits_total{{{NS}}}[{W}])) / "
             f"sum by (pod) (rate(baton_prefix_cache_queries_total{{{NS}}}[{W}]))", "{{pod}}"),
        ]),
    ]),
    ("Disaggregation", [
        ("Remote prefill share", "percentunit", [
            (f'sum(rate(baton_router_prefill_decisions_total{{choice="remote",{R}}}[{W}])) / '
             f"sum(rate(baton_router_prefill_decisions_total{{{R}}}[{W}]))", "remote"),
        ]),
        ("KV transfer bandwidth", "Bps", [
            (f"sum by (pod) (rate(baton_kv_transfer_bytes_total{{{NS}}}[{W}]))", "{{pod}}"),
        ]),
        ("KV handoff time p90", "s", [
            (f"histogram_quantile(0.9, sum by (le) (rate(baton_kv_transfer_seconds_bucket{{{NS}}}[{W}])))", "p90"),
        ]),
    ]),
    ("Speculative decoding", [
        ("Draft acceptance rate", "percentunit", [
            (f"sum by (proposer) (rate(baton_spec_accepted_tokens_total{{{NS}}}[{W}])) / "
             f"sum by (proposer) (rate(baton_spec_proposed_tokens_total{{{NS}}}[{W}]))", "{{proposer}}"),
        ]),
    ]),
    ("Planner and nodes", [
        ("Desired vs actual replicas", "short", [
            (f"max by (role) (baton_planner_desired_replicas{{{R}}})", "desired {{role}}"),
            (f"max by (role) (baton_router_nodes{{{R}}})", "in view {{role}}"),
        ]),
        ("Running sequences per node", "short", [
            (f'baton_running_sequences{{component=~"prefill|decode",{NS}}}', "{{pod}}"),
        ]),
        ("Generated tokens per second per node", "short", [
            (f'sum by (pod) (rate(baton_generation_tokens_total{{component="decode",{NS}}}[{W}]))', "{{pod}}"),
        ]),
        ("Migrations", "short", [
            (f"sum(increase(baton_migrations_total{{{R}}}[{W}]))", "streams moved"),
        ]),
    ]),
]


def panel(pid: int, title: str, unit: str, targets: list, x: int, y: int) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": e, "legendFormat": leg,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (e, leg) in enumerate(targets)],
    }


def dashboard() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(row):
            if i and i % 3 == 0:
                y += 8
            panels.append(panel(pid, title, unit, targets, (i % 3) * 8, y))
            pid += 1
        y += 8
    return {
        "uid": "baton-overview",
        "title": "baton",
        "tags": ["baton", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "namespace", "type": "query", "label": "Namespace", "includeAll": False, "multi": False,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(baton_router_nodes, namespace)", "refId": "ns"},
             "definition": "label_values(baton_router_nodes, namespace)", "refresh": 2},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1, sort_keys=True) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not what {__file__} writes: run it", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
