"""Telemetry: what the app exports and how it is read back, below both the app and the agents.

metrics (every metric the app exports, by spec), queries (the named PromQL
built from those specs), snapshot (the queries run against Prometheus into one
typed Snapshot), observability (Prometheus rules and the Grafana dashboard from
the config's SLOs), prometheus (a local Prometheus server).
"""
