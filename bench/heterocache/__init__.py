"""HeteroCache benchmarks: SWA checkpoint policies in the simulator."""
