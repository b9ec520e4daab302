"""Position-independent caching inside the engine: segments, pieces, the plan, assembly and the per-step PIC inputs."""
