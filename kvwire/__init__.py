"""What the router and the workers agree on about KV, owned by neither (`beamserve.kvwire`).

- `geometry`: `KVGeometry`, one worker's KV-cache geometry (block size, sliding window, hash
  scheme, event format) as one frozen, validated value;
- `events`: the KV-event types (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`,
  `KVEventBatch`) and their msgpack wire encoding in vLLM's and SGLang's formats (no sockets:
  the workers' ZMQ publisher and the router's subscriber each own their side of the wire);
- `hashing`: prefix-cache block hashes exactly as vLLM and SGLang compute them;
- `codec`: chat-template rendering and tokenization exactly as the engine does it.
"""
