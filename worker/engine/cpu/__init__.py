"""The CPU engine's runtime, beside its kernels (tokenmill.kernels.cpu): how many threads it computes
with (threads.py), a step cut into parts that run side by side (step_parts.py), and the host memory
settings that must act before torch allocates the model (host_memory.py)."""
