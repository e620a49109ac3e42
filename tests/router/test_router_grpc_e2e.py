"""`beamserve router --grpc-port`: the Envoy ext_proc endpoint picker and the native
`beamserve.router.v1.Router/Route`, driven with the messages Envoy (or a programmatic client)
sends, in front of real sim workers — a session's requests are picked to the same worker."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from beamserve.router.grpc_api import router_v1
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.conftest import SpawnWorker
from tests.router.test_grpc import envoy_request, set_headers


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
