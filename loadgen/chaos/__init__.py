"""`ownerserve bench chaos`: sustained agentic load through two router replicas that share one
Redis ownership directory, on emulated workers, while a seeded fault schedule kills, stops and
restarts workers, Redis and a replica; the report says whether any request hung, any session
was lost, any KV stayed held or any directory entry kept naming a dead worker.

`schedule` (the faults, pure), `load` (the client), `probe` (what the run reads: the directory
straight from Redis, the processes' /proc, the servers' /metrics), `topology` (the processes),
`run` (the run), `report` (JSON and Markdown).
"""

from loadgen.chaos.run import ChaosPlan, run_chaos
from loadgen.chaos.schedule import FAULT_KINDS, ScheduledFault, fault_schedule

__all__ = ["FAULT_KINDS", "ChaosPlan", "ScheduledFault", "fault_schedule", "run_chaos"]
