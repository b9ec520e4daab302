"""Position-independent caching inside the engine: segments, pieces, the plan, a sequence's PIC state,
assembly, CUDA graphs of the assembly step, and the host-side build of each step's PIC inputs
(`hypic.models.batch` holds their types)."""
