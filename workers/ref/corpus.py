"""The text the tiny tokenizer is trained on, and the prompts the checks send.

A few KB of code-ish lines of the kind agent harnesses send (Python, shell, YAML, diffs, plain
English about serving). Embedded as a module so the package needs no data files.
"""

from __future__ import annotations

CORPUS = r'''
def prefill(self, token_ids: list[int]) -> KVCache:
    """Run the prompt once and keep every layer's keys and values."""
    cache = DynamicCache(config=self.config)
    for start in range(0, len(token_ids), self.chunk):
        logits = self.forward(token_ids[start : start + self.chunk], cache, start)
    return cache, int(logits[0, -1].argmax())

def decode(self, cache: KVCache, token: int, steps: int) -> list[int]:
    out = [token]
    for position in range(self.seq_len, self.seq_len + steps - 1):
        logits = self.forward([out[-1]], cache, position)
        out.append(int(logits[0, -1].argmax()))
    return out

class PagePool:
    def __init__(self, pages: int) -> None:
        self.free = list(range(pages))
        self.refs = [0] * pages

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"need {n} pages, {len(self.free)} free")
        taken, self.free = self.free[:n], self.free[n:]
        for page in taken:
            self.refs[page] = 1
        return taken

import json
import os
import sys
from pathlib import Path

def load_config(path: str) -> dict:
    with open(Path(path) / "config.json") as f:
        return json.load(f)

if __name__ == "__main__":
    cfg = load_config(sys.argv[1])
    print(cfg["num_hidden_layers"], cfg["sliding_window"], os.getpid())

for i in range(10):
    if i % 2 == 0:
        print("even", i)
    else:
        print("odd", i)

async def handle(request):
    body = await request.json()
    messages = body.get("messages", [])
    stream = body.get("stream", False)
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": []}

$ git status
On branch main
Changes not staged for commit:
  modified:   src/router/prefix_index.py
$ git diff --stat
 src/router/prefix_index.py | 12 ++++++++----
$ pytest -q tests/test_router.py
....................                                                     [100%]
20 passed in 1.42s
$ kubectl get pods -n beam
NAME                       READY   STATUS    RESTARTS   AGE
beam-prefill-0             1/1     Running   0          12m
beam-decode-0              1/1     Running   0          12m
$ helm upgrade --install beamserve charts/beamserve -n beam

apiVersion: apps/v1
kind: Deployment
metadata:
  name: beam-decode
  labels:
    app: beamserve
    role: decode
spec:
  replicas: 2
  template:
    spec:
      containers:
        - name: engine
          image: beamserve/worker:0.1.0
          args: ["worker", "--role", "decode", "--tp", "4"]
          resources:
            limits:
              nvidia.com/gpu: 4

--- a/router/score.py
+++ b/router/score.py
@@ -10,7 +10,7 @@ def score(pod, request):
-    return overlap * weight
+    return overlap * weight - load * penalty
     # prefer the pod that already holds the prefix

Fix the failing test in tests/test_scheduler.py: the queue must never hold a request twice.
Read the file, find the bug, and write a patch with a short explanation.
The prefill pool computes the prompt and hands the cache to the decode pool.
Sliding window layers keep only the last window of tokens; full layers keep them all.
When the prefill worker dies, the decode worker recomputes the prompt and still answers.
A prefix cache lets a later turn of the same session reuse the keys and values of earlier turns.
Explain what this function returns and when it raises an error.
Add type hints to every function in this module and make mypy strict pass.
Write a unit test for the page allocator: allocate, free, and allocate again.
List the files that changed and summarise each change in one line.
'''

# Opening user turns for the checks: each becomes one chat-templated prompt.
USER_TURNS = (
    "Read the file, find the bug in prefill, and write a patch with a short explanation.",
    "Write a unit test for the page allocator: allocate, free, and allocate again. "
    "Use pytest and keep it short.",
    "Explain what decode returns and when it raises an error, then add type hints to every "
    "function in this module so that mypy strict passes.",
    "List the files that changed and summarise each change in one line.",
    "The prefill worker died. Explain how the decode worker recomputes the prompt, "
    "and what a prefix cache lets a later turn reuse.",
    "Fix the failing test: the queue must never hold a request twice.",
)

SYSTEM_PROMPT = "You are a coding agent. Answer with code when you can."

FOLLOW_UP = "Now make the change and run the tests again."
