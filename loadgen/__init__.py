"""Workloads, the replay client, reports and the cluster simulator."""
