"""`beamserve router --grpc-port`: the Envoy ext_proc endpoint picker and the native
`beamserve.router.v1.Router/Route`, driven with the messages Envoy (or a programmatic client)
sends, in front of real sim workers — a session's requests are picked to the same worker."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from beamserve.router.grpc_api import router_v1
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.conftest import SpawnWorker
from tests.router.test_grpc import envoy_request, envoy_response, set_headers


def test_ext_proc_and_route_pick_real_workers(
    spawn_worker: SpawnWorker, tiny_checkpoint: Path
) -> None:
    workers = [spawn_worker("--engine", "sim", "--model", str(tiny_checkpoint)) for _ in range(2)]
    specs = [{"url": w.url, "role": "both"} for w in workers]
    router = spawn_worker(
        "--endpoints", json.dumps(specs), "--tokenizer", str(tiny_checkpoint),
        "--grpc-port", "0", command="router",
    )  # fmt: skip
    addresses = {w.url.removeprefix("http://") for w in workers}
    channel = grpc.insecure_channel(f"127.0.0.1:{router.info['grpc_port']}")
    try:
        stub = pb_grpc.ExternalProcessorStub(channel)
        body = json.dumps(
            {"model": "beam", "messages": [{"role": "user", "content": "fix the test " * 50}]}
        ).encode()
        picks = []
        for _ in range(3):
            resps = list(stub.Process(iter(envoy_request(body, [100, 900])), timeout=20))
            headers = next(set_headers(r) for r in resps if r.HasField("request_headers"))
            picks.append(headers["x-gateway-destination-endpoint"])
            meta = next(r.dynamic_metadata for r in resps if r.HasField("request_headers"))
            lb = meta.fields["envoy.lb"].struct_value.fields
            assert lb["x-gateway-destination-endpoint"].string_value == picks[-1]
        assert picks[0] in addresses and len(set(picks)) == 1  # same session, same worker
        bad = list(stub.Process(iter(envoy_request(b"{not json")), timeout=20))
        assert bad[-1].immediate_response.status.code == 400
        route = channel.unary_unary(
            "/beamserve.router.v1.Router/Route",
            request_serializer=router_v1.RouteRequest.SerializeToString,
            response_deserializer=router_v1.RouteDecision.FromString,
        )
        decision = route(
            router_v1.RouteRequest(request_id="r1", model="beam", prompt="hello " * 200),
            timeout=20,
        )
        assert decision.decode_endpoint.address in addresses
        assert decision.reason
    finally:
        channel.close()


def test_ext_proc_picks_release_their_load_when_envoy_reports_the_end(
    spawn_worker: SpawnWorker,
) -> None:
    """Each pick books load on its worker; Envoy's end of the response (end of stream, or the
    stream closing without one) releases it: after N requests the router's books are empty."""
    workers = [spawn_worker("--engine", "sim") for _ in range(2)]
    specs = [{"url": w.url, "role": "both"} for w in workers]
    router = spawn_worker(
        "--endpoints", json.dumps(specs), "--grpc-port", "0", command="router"
    )  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{router.info['grpc_port']}")

    def books() -> list[int]:
        return [w["load"]["in_flight"] for w in httpx.get(router.url + "/debug/workers").json()]

    try:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for i in range(6):
            body = json.dumps(
                {"model": "beam", "messages": [{"role": "user", "content": f"task {i} " * 40}]}
            ).encode()
            # Envoy: request headers and body, then (for most) the upstream's response.
            msgs = envoy_request(body)
            if i % 3 != 2:
                msgs += envoy_response([b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
            list(stub.Process(iter(msgs), timeout=20))
        # A pick whose response never starts: the stream stays open, the load is booked...
        requests: queue.Queue[Any] = queue.Queue()
        body = json.dumps({"model": "beam", "messages": [{"role": "user", "content": "x"}]})
        for m in envoy_request(body.encode()):
            requests.put(m)
        stream = stub.Process(iter(requests.get, None), timeout=20)
        next(stream)  # the pick's answer
        assert sum(books()) == 1
        requests.put(None)  # ...until Envoy closes the stream
        list(stream)
        deadline = time.monotonic() + 5
        while sum(books()) != 0:
            assert time.monotonic() < deadline, books()
            time.sleep(0.05)
    finally:
        channel.close()
