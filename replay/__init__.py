"""Trace-driven replay: recorded workloads through candidate policies on a modelled engine.

``replay.traces`` reads public trace formats into one workload table, ``replay.workload`` describes
workloads and turns them into events. The replay engine emits the same event schema as a real
engine, so one metrics path serves real and replayed data.
"""
