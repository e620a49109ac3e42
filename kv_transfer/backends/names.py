"""Transfer backend names (no imports: command lines read them without loading a backend)."""

# Backends that move host memory (what CPU-only machines test); cuda_ipc moves VRAM only.
BACKENDS = ("nixl", "mooncake", "cma", "shm")
ALL_BACKENDS = (*BACKENDS, "cuda_ipc")
# Backends whose regions must live in shared memory (`memory.allocate(..., shared=True)`).
SHARED_MEMORY = ("shm",)
