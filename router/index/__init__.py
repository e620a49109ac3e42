"""beamserve.router.index: the prefix index and the KV-event subscribers that feed it.

`PrefixIndex` (prefix_index.py) answers which blocks each worker holds; `KVEventSubscriber` /
`KVEventHub` (subscriber.py) keep it in step with the workers' ZMQ KV-event streams.
"""

from beamserve.router.index.prefix_index import (
    IndexStats,
    PrefixIndex,
    PrefixIndexError,
    PrefixMatch,
    block_key,
    measure_index_memory,
)
from beamserve.router.index.subscriber import (
    KVEventHub,
    KVEventsConfigError,
    KVEventSubscriber,
    SubscriberConfig,
    SubscriberStats,
)

__all__ = [
    "IndexStats",
    "KVEventHub",
    "KVEventSubscriber",
    "KVEventsConfigError",
    "PrefixIndex",
    "PrefixIndexError",
    "PrefixMatch",
    "SubscriberConfig",
    "SubscriberStats",
    "block_key",
    "measure_index_memory",
]
