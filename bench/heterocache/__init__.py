"""HeteroCache benchmarks: SWA checkpoint policies in the simulator, and predicted against
delivered prefix hits through the router."""
