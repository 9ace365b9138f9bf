"""The weight sync's bucket size: how many bytes of packed tensors one broadcast carries.

Here, not in ``transport.py``, so that the memory planner (which charges one bucket in flight and
one filling) reads it without importing torch.
"""

DEFAULT_BUCKET_BYTES = 1 << 30

# Buckets of a version on a sender's device while its host snapshot captures a lazily gathered
# stream (FSDP rank 0, sync/snapshot.py: HostSnapshot.capture): the bucket being copied to the
# host, the bucket being gathered (the producer waits for the copies of the bucket before, no
# further), and the next bucket's first tensor, which iter_buckets reads ahead (at most a
# bucket). A receiver holds two (one in flight, one filling).
CAPTURE_DEVICE_BUCKETS = 3
