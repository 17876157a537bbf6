"""The worker sidecar: a per-worker KV artifact store (memory and SSD tiers, checksummed,
utility-ranked eviction) that other workers fetch sealed prefix artifacts from."""
