"""The router's gRPC services over real loopback gRPC.

The ext_proc client plays Envoy's documented message sequence for `FULL_DUPLEX_STREAMED`
(request headers, streamed body chunks, end of stream, then response headers / body / trailers),
sending everything without waiting for answers, as Envoy does in that mode. No Envoy binary is
available here (REFERENCE.md, Gateway).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import beamserve.router.grpc_api as grpc_api
import grpc
import pytest
from beamserve.router.grpc_api import (
    ExtProcConfig,
    HealthState,
    PickResult,
    RouteQuery,
    RouteRejected,
    build_server,
    health,
    router_v1,
)
from beamserve.router.types import Endpoint, PrefixHit, RouteDecision
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import descriptor_pb2, json_format, struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
MAX_BODY = 300_000
DEST = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"


# -- the injected callables: real functions of their inputs, recording what they saw ----------


class Recorder:
    def __init__(self) -> None:
        self.picks: list[tuple[dict[str, str], bytes]] = []
        self.routes: list[RouteQuery] = []

    async def pick(self, headers: Mapping[str, str], body: bytes) -> PickResult:
        self.picks.append((dict(headers), body))
        outcome = headers.get("x-test-outcome", "pick")
        if outcome == "none":
            return PickResult.unavailable("no ready decode worker", retry_after_s=2)
        if outcome == "shed":
            return PickResult.shed("band sheddable over capacity", retry_after_s=1.5)
        if outcome == "raise-shed":
            raise RouteRejected(429, "queue full", retry_after_s=4)
        if outcome == "boom":
            raise RuntimeError("picker bug")
        if outcome == "outside":
            return PickResult.picked("10.9.9.9:1")
        if SUBSET in headers:
            return PickResult.picked(headers[SUBSET].split(",")[-1])
        if outcome == "pd":
            return PickResult.picked(
                "10.0.0.7:8000",
                fallbacks=["10.0.0.8:8000"],
                set_headers=[("x-prefiller-host-port", "10.0.1.1:8000")],
            )
        return PickResult.picked("10.0.0.7:8000")

    async def route(self, query: RouteQuery) -> RouteDecision:
        self.routes.append(query)
        if query.model == "shed-me":
            raise RouteRejected(429, "sheddable band over capacity", retry_after_s=2.5)
        if query.model == "nothing":
            raise RouteRejected(503, "no decode worker for model 'nothing'")
        if query.model == "boom":
            raise RuntimeError("policy bug")
        decode = Endpoint(id="dec-0", url="http://10.0.0.7:8000", role="decode", revision="r1")
        prefill = Endpoint(id="pre-0", url="http://[fd00::5]:8100", role="prefill", engine="vllm")
        return RouteDecision(
            decode=decode,
            prefill=prefill if query.session_id else None,
            expected_hit=PrefixHit(full_blocks=len(query.block_hashes or ()), window_ok=True),
            reason="prefix",
            explain=f"{len(query.token_ids or ())} tokens",
            scores=(("dec-0", 0.75), ("dec-1", 0.25)),
        )


class Served:
    """The router's gRPC server on its own event loop in a thread; tests use sync clients."""

    def __init__(self, recorder: Recorder) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port, self.server, self.health = self.call(self._start(recorder))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=20)

    async def _start(self, recorder: Recorder) -> tuple[int, grpc.aio.Server, HealthState]:
        server, port, state = build_server(
            0,
            recorder.pick,
            recorder.route,
            host="127.0.0.1",
            ext_proc_config=ExtProcConfig(max_body_bytes=MAX_BODY),
        )
        await server.start()
        return port, server, state

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def served(recorder: Recorder) -> Iterator[Served]:
    s = Served(recorder)
    yield s
    s.close()


# -- Envoy's side of ext_proc ------------------------------------------------------------------


def _headers(path: str, extra: Mapping[str, str] = {}, method: str = "POST") -> base_pb2.HeaderMap:
    pairs = {
        ":method": method,
        ":path": path,
        ":authority": "gw.example",
        ":scheme": "http",
        "content-type": "application/json",
        "x-session-id": "sess-42",
        **extra,
    }
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )


def envoy_request(
    body: bytes,
    chunks: list[int] | None = None,
    *,
    path: str = "/v1/chat/completions",
    extra: Mapping[str, str] = {},
    subset: list[str] | None = None,
    trailers: bool = False,
    mode: int | None = None,
) -> list[pb.ProcessingRequest]:
    """What Envoy sends for one request: headers, then the body split at `chunks` offsets."""
    first = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=_headers(path, extra), end_of_stream=not body)
    )
    if mode is not None:
        first.protocol_config.request_body_mode = mode
        first.protocol_config.response_body_mode = mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET: subset})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    msgs = [first]
    if not body:
        return msgs
    cuts = sorted({c for c in (chunks or []) if 0 < c < len(body)})
    bounds = [0, *cuts, len(body)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        msgs.append(
            pb.ProcessingRequest(
                request_body=pb.HttpBody(body=body[a:b], end_of_stream=last and not trailers)
            )
        )
    if trailers:
        msgs.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    return msgs


def envoy_response(body_chunks: list[bytes]) -> list[pb.ProcessingRequest]:
    status = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":status", raw_value=b"200"),
            base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
        ]
    )
    msgs = [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status))]
    for i, chunk in enumerate(body_chunks):
        msgs.append(
            pb.ProcessingRequest(
                response_body=pb.HttpBody(body=chunk, end_of_stream=i == len(body_chunks) - 1)
            )
        )
    return msgs


def process(served: Served, msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    stub = pb_grpc.ExternalProcessorStub(served.channel)
    return list(stub.Process(iter(msgs), timeout=10))


def set_headers(resp: pb.ProcessingResponse, which: str = "request_headers") -> dict[str, str]:
    mutation = getattr(resp, which).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def streamed(resps: list[pb.ProcessingResponse], which: str = "request_body") -> list[Any]:
    return [getattr(r, which).response.body_mutation.streamed_response for r in resps]


CHAT = json.dumps(
    {"model": "beam", "messages": [{"role": "user", "content": "fix the failing test " * 40}]}
).encode()


# -- ext_proc ----------------------------------------------------------------------------------


def test_full_duplex_pick_answers_header_metadata_and_body(
    served: Served, recorder: Recorder
) -> None:
    msgs = envoy_request(CHAT, [100, 333], extra={"x-test-outcome": "pd"})
    resps = process(served, msgs + envoy_response([b"data: {}\n\n", b"data: [DONE]\n\n"]))

    headers_resp, *rest = resps
    assert headers_resp.WhichOneof("response") == "request_headers"
    assert headers_resp.request_headers.response.clear_route_cache
    sets = set_headers(headers_resp)
    assert sets[DEST] == "10.0.0.7:8000,10.0.0.8:8000"
    assert sets["x-prefiller-host-port"] == "10.0.1.1:8000"
    assert sets["content-length"] == str(len(CHAT))
    for opt in headers_resp.request_headers.response.header_mutation.set_headers:
        assert opt.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    meta = json_format.MessageToDict(headers_resp.dynamic_metadata)
    assert meta == {"envoy.lb": {DEST: "10.0.0.7:8000,10.0.0.8:8000"}}

    kinds = [r.WhichOneof("response") for r in rest]
    assert kinds == ["request_body", "response_headers", "response_body", "response_body"]
    body_chunks = streamed(rest[:1])
    assert b"".join(c.body for c in body_chunks) == CHAT
    assert body_chunks[-1].end_of_stream
    echoed = streamed(rest[2:], "response_body")
    assert [c.body for c in echoed] == [b"data: {}\n\n", b"data: [DONE]\n\n"]
    assert [c.end_of_stream for c in echoed] == [False, True]

    seen_headers, seen_body = recorder.picks[-1]
    assert seen_body == CHAT
    assert seen_headers[":path"] == "/v1/chat/completions"
    assert seen_headers["x-session-id"] == "sess-42"
    assert seen_headers["content-type"] == "application/json"


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.binary(min_size=1, max_size=200_000),
    cuts=st.lists(st.integers(min_value=1, max_value=199_999), max_size=6),
)
def test_body_comes_back_byte_identical_in_bounded_chunks(
    served: Served, recorder: Recorder, body: bytes, cuts: list[int]
) -> None:
    resps = process(served, envoy_request(body, cuts))
    assert resps[0].WhichOneof("response") == "request_headers"
    chunks = streamed(resps[1:])
    assert all(r.WhichOneof("response") == "request_body" for r in resps[1:])
    assert b"".join(c.body for c in chunks) == body
    assert all(len(c.body) <= 62_000 for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert recorder.picks[-1][1] == body


def test_request_without_body_is_picked_on_headers(served: Served, recorder: Recorder) -> None:
    msgs = [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=_headers("/v1/models", method="GET"), end_of_stream=True
            )
        )
    ]
    (resp,) = process(served, msgs)
    assert set_headers(resp) == {DEST: "10.0.0.7:8000"}  # no content-length for no body
    assert json_format.MessageToDict(resp.dynamic_metadata)["envoy.lb"][DEST] == "10.0.0.7:8000"
    assert recorder.picks[-1] == (recorder.picks[-1][0], b"")
    assert recorder.picks[-1][0][":method"] == "GET"


@pytest.mark.parametrize(
    ("outcome", "path", "status", "retry_after", "shape"),
    [
        ("none", "/v1/chat/completions", 503, "2", "openai"),
        ("shed", "/v1/messages", 429, "2", "anthropic"),
        ("raise-shed", "/v1/completions", 429, "4", "openai"),
        ("boom", "/v1/messages?beta=true", 500, None, "anthropic"),
    ],
)
def test_refusals_are_immediate_responses(
    served: Served,
    outcome: str,
    path: str,
    status: int,
    retry_after: str | None,
    shape: str,
) -> None:
    resps = process(served, envoy_request(CHAT, [50], path=path, extra={"x-test-outcome": outcome}))
    assert [r.WhichOneof("response") for r in resps] == ["immediate_response"]
    imm = resps[0].immediate_response
    assert imm.status.code == status
    headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert headers["content-type"] == "application/json"
    assert headers.get("retry-after") == retry_after
    err = json.loads(imm.body)
    if shape == "anthropic":
        assert err["type"] == "error" and err["error"]["message"]
    else:
        assert err["error"]["code"] == status and err["error"]["message"]
    assert not resps[0].HasField("dynamic_metadata")


def test_subset_hint_restricts_the_pick(served: Served, recorder: Recorder) -> None:
    subset = ["10.1.1.1:8000", "10.1.1.2:8000"]
    msgs = envoy_request(CHAT, subset=subset, extra={SUBSET: "6.6.6.6:1"})  # client spoof
    resps = process(served, msgs)
    assert set_headers(resps[0])[DEST] == "10.1.1.2:8000"
    assert SUBSET in resps[0].request_headers.response.header_mutation.remove_headers
    assert recorder.picks[-1][0][SUBSET] == ",".join(subset)


def test_empty_subset_or_pick_outside_it_is_503(served: Served, recorder: Recorder) -> None:
    before = len(recorder.picks)
    (resp,) = process(served, envoy_request(CHAT, subset=[]))
    assert resp.immediate_response.status.code == 503
    assert len(recorder.picks) == before  # not asked: nothing can fit
    msgs = envoy_request(CHAT, subset=["10.1.1.1:8000"], extra={"x-test-outcome": "outside"})
    (resp,) = process(served, msgs)
    assert resp.immediate_response.status.code == 503
    assert b"outside" in resp.immediate_response.body


def test_request_trailers_end_the_body(served: Served, recorder: Recorder) -> None:
    resps = process(served, envoy_request(CHAT, [10], trailers=True))
    kinds = [r.WhichOneof("response") for r in resps]
    assert kinds[0] == "request_headers" and kinds[-1] == "request_trailers"
    chunks = streamed(resps[1:-1])
    assert b"".join(c.body for c in chunks) == CHAT
    assert not any(c.end_of_stream for c in chunks)  # the trailers end the stream
    assert recorder.picks[-1][1] == CHAT


def test_body_over_limit_is_413(served: Served) -> None:
    body = b"x" * (MAX_BODY + 1)
    (resp,) = process(served, envoy_request(body, [MAX_BODY // 2]))
    assert resp.immediate_response.status.code == 413


def test_buffered_mode_mutates_on_the_body_response(served: Served, recorder: Recorder) -> None:
    resps = process(served, envoy_request(CHAT, mode=BodyMode.BUFFERED))
    assert [r.WhichOneof("response") for r in resps] == ["request_headers", "request_body"]
    assert not resps[0].request_headers.response.HasField("header_mutation")
    body_resp = resps[1]
    assert set_headers(body_resp, "request_body")[DEST] == "10.0.0.7:8000"
    assert not body_resp.request_body.response.HasField("body_mutation")  # body untouched
    meta = json_format.MessageToDict(body_resp.dynamic_metadata)
    assert meta == {"envoy.lb": {DEST: "10.0.0.7:8000"}}
    assert recorder.picks[-1][1] == CHAT


def test_streamed_mode_is_refused_with_the_fix(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as err:
        process(served, envoy_request(CHAT, [5], mode=BodyMode.STREAMED))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "FULL_DUPLEX_STREAMED" in err.value.details()


def test_pick_result_validates_endpoints() -> None:
    with pytest.raises(ValueError, match="ip:port"):
        PickResult.picked("http://10.0.0.1:8000")
    with pytest.raises(ValueError, match="ip:port"):
        PickResult.picked("10.0.0.1:99999")
    with pytest.raises(ValueError, match="error status"):
        PickResult(status=200)
    assert PickResult.picked("[fd00::1]:8000").destination == "[fd00::1]:8000"


# -- native Router service ---------------------------------------------------------------------


def route_call(served: Served, **fields: Any) -> tuple[Any, Any]:
    stub = served.channel.unary_unary(
        "/beamserve.router.v1.Router/Route",
        request_serializer=router_v1.RouteRequest.SerializeToString,
        response_deserializer=router_v1.RouteDecision.FromString,
    )
    decision, call = stub.with_call(router_v1.RouteRequest(**fields), timeout=10)
    return decision, call


def test_route_round_trip(served: Served, recorder: Recorder) -> None:
    decision, _ = route_call(
        served,
        request_id="r-1",
        model="beam",
        session_id="sess-9",
        token_ids=[5, 6, 7, 8],
        headers={"X-Session-Id": "sess-9"},
        band="continuing",
        turn=3,
    )
    query = recorder.routes[-1]
    assert query.request_id == "r-1" and query.token_ids == (5, 6, 7, 8)
    assert query.prompt_tokens == 4  # taken from token_ids
    assert query.prompt is None and query.block_hashes is None
    assert dict(query.headers) == {"x-session-id": "sess-9"}
    assert query.band == "continuing" and query.turn == 3
    assert query.to_route_request(block_hashes=(1, 2)).block_hashes == (1, 2)

    assert decision.decode_endpoint.id == "dec-0"
    assert decision.decode_endpoint.address == "10.0.0.7:8000"
    assert decision.decode_endpoint.role == "decode"
    assert decision.decode_endpoint.revision == "r1"
    assert decision.prefill_endpoint.address == "[fd00::5]:8100"
    assert decision.prefill_endpoint.engine == "vllm"
    assert decision.reason == "prefix" and decision.explain == "4 tokens"
    assert dict(decision.scores) == {"dec-0": 0.75, "dec-1": 0.25}
    assert decision.expected_hit_kind == "none"


def test_route_with_block_hashes_and_no_session(served: Served, recorder: Recorder) -> None:
    hashes = [2**64 - 1, 0, 12345]
    decision, _ = route_call(served, model="beam", block_hashes=hashes, prompt_tokens=192)
    assert recorder.routes[-1].block_hashes == tuple(hashes)
    assert recorder.routes[-1].request_id  # made up when empty
    assert not decision.HasField("prefill_endpoint")
    assert decision.expected_hit_blocks == 3 and decision.expected_hit_kind == "full"


@pytest.mark.parametrize(
    ("fields", "code", "retry", "needle"),
    [
        ({"model": "shed-me"}, grpc.StatusCode.RESOURCE_EXHAUSTED, "3", "capacity"),
        ({"model": "nothing"}, grpc.StatusCode.UNAVAILABLE, None, "no decode worker"),
        ({"model": "boom"}, grpc.StatusCode.INTERNAL, None, "RuntimeError"),
        ({"prompt": "hi", "token_ids": [1]}, grpc.StatusCode.INVALID_ARGUMENT, None, "token_ids"),
        ({"band": "urgent"}, grpc.StatusCode.INVALID_ARGUMENT, None, "sheddable"),
    ],
)
def test_route_errors(
    served: Served, fields: dict[str, Any], code: grpc.StatusCode, retry: str | None, needle: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        route_call(served, **fields)
    assert err.value.code() == code
    assert needle in err.value.details()
    trailers = dict(err.value.trailing_metadata() or ())
    assert trailers.get("retry-after") == retry


# -- health ------------------------------------------------------------------------------------


def test_health_check_and_watch(served: Served) -> None:
    check = served.channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health.HealthCheckRequest.SerializeToString,
        response_deserializer=health.HealthCheckResponse.FromString,
    )
    for name in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert check(health.HealthCheckRequest(service=name)).status == health.SERVING
    with pytest.raises(grpc.RpcError) as err:
        check(health.HealthCheckRequest(service="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    watch = served.channel.unary_stream(
        "/grpc.health.v1.Health/Watch",
        request_serializer=health.HealthCheckRequest.SerializeToString,
        response_deserializer=health.HealthCheckResponse.FromString,
    )
    stream = watch(health.HealthCheckRequest(service="readiness"), timeout=10)
    assert next(stream).status == health.SERVING
    served.loop.call_soon_threadsafe(served.health.set, "readiness", False)
    assert next(stream).status == health.NOT_SERVING
    served.loop.call_soon_threadsafe(served.health.set, "readiness", True)
    assert next(stream).status == health.SERVING
    stream.cancel()


# -- the documented .proto agrees with the descriptors built in code ---------------------------

PROTO = Path(grpc_api.__file__).parent / "proto" / "beamserve" / "router" / "v1" / "router.proto"


def parse_proto(text: str) -> dict[str, Any]:
    """A small parser for the subset of proto3 router.proto uses: package, messages with scalar,
    message, repeated and map fields, one service with unary rpcs."""
    text = re.sub(r"//[^\n]*", "", text)
    tokens = re.findall(r"[A-Za-z_][\w.]*|\d+|[{}();=<>,\"]", text)
    out: dict[str, Any] = {"messages": {}, "rpcs": {}}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "package":
            out["package"] = tokens[i + 1]
            i += 3
        elif tok == "message":
            name, fields = tokens[i + 1], {}
            i += 3
            while tokens[i] != "}":
                if tokens[i] == "map":  # map < K , V > name = N ;
                    key, value, fname, num = (
                        tokens[i + 2],
                        tokens[i + 4],
                        tokens[i + 6],
                        tokens[i + 8],
                    )
                    fields[fname] = (int(num), f"map<{key},{value}>")
                    i += 10
                elif tokens[i] == "repeated":
                    ftype, fname, num = tokens[i + 1], tokens[i + 2], tokens[i + 4]
                    fields[fname] = (int(num), f"repeated {ftype}")
                    i += 6
                else:
                    ftype, fname, num = tokens[i], tokens[i + 1], tokens[i + 3]
                    fields[fname] = (int(num), ftype)
                    i += 5
            out["messages"][name] = fields
            i += 1
        elif tok == "rpc":  # rpc Name ( In ) returns ( Out ) ;
            out["rpcs"][tokens[i + 1]] = (tokens[i + 3], tokens[i + 7])
            i += 9
        elif tok == "service":
            out["service"] = tokens[i + 1]
            i += 3
        else:
            i += 1
    return out


_TYPE_NAMES = {
    descriptor_pb2.FieldDescriptorProto.TYPE_STRING: "string",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32: "uint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: "uint64",
    descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE: "double",
}


def describe(fd: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    def short(type_name: str) -> str:
        return type_name.rsplit(".", 1)[-1]

    messages: dict[str, Any] = {}
    for msg in fd.message_type:
        entries = {n.name: n for n in msg.nested_type if n.options.map_entry}
        fields: dict[str, Any] = {}
        for f in msg.field:
            if f.type == f.TYPE_MESSAGE and short(f.type_name) in entries:
                k, v = entries[short(f.type_name)].field
                fields[f.name] = (f.number, f"map<{_TYPE_NAMES[k.type]},{_TYPE_NAMES[v.type]}>")
                continue
            ftype = short(f.type_name) if f.type == f.TYPE_MESSAGE else _TYPE_NAMES[f.type]
            prefix = "repeated " if f.label == f.LABEL_REPEATED else ""
            fields[f.name] = (f.number, prefix + ftype)
        messages[msg.name] = fields
    (svc,) = fd.service
    return {
        "package": fd.package,
        "service": svc.name,
        "messages": messages,
        "rpcs": {m.name: (short(m.input_type), short(m.output_type)) for m in svc.method},
    }


def test_proto_file_matches_built_descriptors() -> None:
    documented = parse_proto(PROTO.read_text())
    built = describe(router_v1.FILE)
    assert documented == built
    assert set(built["messages"]) == {"RouteRequest", "Endpoint", "RouteDecision"}
    assert built["messages"]["RouteRequest"]["headers"] == (8, "map<string,string>")


def test_parser_sees_a_drifted_field() -> None:
    """The agreement test can fail: renumbering one field in the text is caught."""
    drifted = PROTO.read_text().replace("string reason = 5;", "string reason = 15;")
    assert parse_proto(drifted) != describe(router_v1.FILE)


def test_serve_binds_all_services_on_one_port(recorder: Recorder) -> None:
    """`serve` (the entry point the router's CLI uses) with the aio client stub."""

    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = await grpc_api.serve(port, recorder.pick, recorder.route, host="127.0.0.1")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                decision = await grpc_api.RouterStub(channel).Route(
                    router_v1.RouteRequest(model="beam", prompt="hello"), timeout=10
                )
                assert decision.decode_endpoint.id == "dec-0"
                assert recorder.routes[-1].prompt == "hello"
                check = channel.unary_unary(
                    "/grpc.health.v1.Health/Check",
                    request_serializer=health.HealthCheckRequest.SerializeToString,
                    response_deserializer=health.HealthCheckResponse.FromString,
                )
                reply = await check(health.HealthCheckRequest(service="beamserve.router.v1.Router"))
                assert reply.status == health.SERVING
                ext = pb_grpc.ExternalProcessorStub(channel).Process(
                    iter(envoy_request(b"", path="/v1/models"))
                )
                (resp,) = [r async for r in ext]
                assert set_headers(resp)[DEST] == "10.0.0.7:8000"
        finally:
            await server.stop(None)

    asyncio.run(main())
