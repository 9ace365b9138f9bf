"""The weight sync's bucket size: how many bytes of packed tensors one broadcast carries.

Here, not in ``transport.py``, so that the memory planner (which charges one bucket in flight and
one filling) reads it without importing torch.
"""

DEFAULT_BUCKET_BYTES = 1 << 30
