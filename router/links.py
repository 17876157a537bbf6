"""The router's estimate of each node's NIC backlog, for the planner's T_network.

KV that leaves a node over the inter-node network waits for what the node's NIC already sends.
The router does not see the bytes on the wire, but it started every transfer its plans make
(a remote prefill's P→D hand-over, an artifact fetch, a state migration), and each plan says
how long its transfer keeps the source node's NIC busy (`CostBreakdown.t_nic`, from the
timing profile and the destination's link calibration). `NicLedger` queues those FIFO per
node, as the cluster simulator's NIC model does, and answers how long a new transfer from a
node would wait (`WorkerView.nic_backlog_s`). A transfer that did not happen (its plan failed
before the first byte, or its fetch failed and the worker recomputed) is taken back out. The
estimate errs where the profile does; the link calibration corrects the per-transfer time,
not the queue.
"""

from __future__ import annotations


class NicLedger:
    """Per node, when the transfers the router queued on its NIC will have left (monotonic
    seconds). Pure bookkeeping: the caller passes the time."""

    __slots__ = ("_free_at",)

    def __init__(self) -> None:
        self._free_at: dict[str, float] = {}

    def __len__(self) -> int:
        """Nodes with transfers queued (some may have drained since: `backlog` drops them)."""
        return len(self._free_at)

    def backlog(self, node: str, now: float) -> float:
        """Seconds before a transfer queued on `node`'s NIC now would start."""
        free_at = self._free_at.get(node)
        if free_at is None:
            return 0.0
        if free_at <= now:
            del self._free_at[node]  # drained: nodes with nothing queued hold no entry
            return 0.0
        return free_at - now

    def reserve(self, node: str, seconds: float, now: float) -> None:
        """Queue a transfer of `seconds` on `node`'s NIC."""
        if seconds <= 0:
            return
        free_at = self._free_at.get(node, now)
        self._free_at[node] = (free_at if free_at > now else now) + seconds

    def release(self, node: str, seconds: float, now: float) -> None:
        """Take back a reserved transfer that did not happen."""
        free_at = self._free_at.get(node)
        if free_at is None or seconds <= 0:
            return
        free_at -= seconds
        if free_at > now:
            self._free_at[node] = free_at
        else:
            del self._free_at[node]

    def snapshot(self, now: float) -> dict[str, float]:
        """Every node's current backlog in seconds (for the admin API and logs)."""
        return {node: free_at - now for node, free_at in self._free_at.items() if free_at > now}


__all__ = ["NicLedger"]
