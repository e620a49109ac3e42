"""`beamserve.router.v1` protobuf messages, built in Python at import time.

The documented contract is `proto/beamserve/router/v1/router.proto` (shipped next to this
module); this module builds the identical `FileDescriptorProto` by hand so the server needs no
protoc step, and `tests/router/test_grpc_router_service.py` checks both agree field by field.
Change both together.

The descriptors live in a private `DescriptorPool` (`POOL`), so a protoc-generated copy of the
same file imported elsewhere cannot collide with them.

Public names: `RouteRequest`, `Endpoint`, `RouteDecision` (message classes), `FILE` (the
`FileDescriptorProto`), `SERVICE_NAME`, `ROUTE_METHOD` (the full method path).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "beamserve.router.v1"
SERVICE_NAME = f"{PACKAGE}.Router"
ROUTE_METHOD = f"/{SERVICE_NAME}/Route"
PROTO_PATH = "beamserve/router/v1/router.proto"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS: dict[str, int] = {
    "string": _F.TYPE_STRING,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "double": _F.TYPE_DOUBLE,
    "bool": _F.TYPE_BOOL,
}


def _field(
    msg: descriptor_pb2.DescriptorProto,
    name: str,
    number: int,
    type_name: str,
    *,
    repeated: bool = False,
) -> None:
    f = msg.field.add(name=name, number=number, json_name=_json_name(name))
    f.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
    if type_name in _SCALARS:
        f.type = _SCALARS[type_name]
    else:
        f.type = _F.TYPE_MESSAGE
        f.type_name = type_name if type_name.startswith(".") else f".{PACKAGE}.{type_name}"


def _map_field(
    msg: descriptor_pb2.DescriptorProto, name: str, number: int, key: str, value: str
) -> None:
    entry_name = "".join(part.capitalize() for part in name.split("_")) + "Entry"
    entry = msg.nested_type.add(name=entry_name)
    entry.options.map_entry = True
    _field(entry, "key", 1, key)
    _field(entry, "value", 2, value)
    _field(msg, name, number, f".{PACKAGE}.{msg.name}.{entry_name}", repeated=True)


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name=PROTO_PATH, package=PACKAGE, syntax="proto3")

    req = fd.message_type.add(name="RouteRequest")
    _field(req, "request_id", 1, "string")
    _field(req, "model", 2, "string")
    _field(req, "session_id", 3, "string")
    _field(req, "prompt", 4, "string")
    _field(req, "token_ids", 5, "uint32", repeated=True)
    _field(req, "block_hashes", 6, "uint64", repeated=True)
    _field(req, "prompt_tokens", 7, "uint32")
    _map_field(req, "headers", 8, "string", "string")
    _field(req, "max_tokens", 9, "uint32")
    _field(req, "turn", 10, "uint32")
    _field(req, "band", 11, "string")

    ep = fd.message_type.add(name="Endpoint")
    for number, name in enumerate(
        ("id", "url", "address", "role", "pool", "revision", "engine"), start=1
    ):
        _field(ep, name, number, "string")

    dec = fd.message_type.add(name="RouteDecision")
    _field(dec, "decode_endpoint", 1, "Endpoint")
    _field(dec, "prefill_endpoint", 2, "Endpoint")
    _field(dec, "expected_hit_blocks", 3, "uint32")
    _field(dec, "expected_hit_kind", 4, "string")
    _field(dec, "reason", 5, "string")
    _field(dec, "explain", 6, "string")
    _map_field(dec, "scores", 7, "string", "double")

    svc = fd.service.add(name="Router")
    svc.method.add(
        name="Route",
        input_type=f".{PACKAGE}.RouteRequest",
        output_type=f".{PACKAGE}.RouteDecision",
    )
    return fd


FILE = _build_file()
POOL = descriptor_pool.DescriptorPool()
FILE_DESCRIPTOR = POOL.Add(FILE)


def _message_class(name: str) -> Any:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


# Message classes (protobuf's generated-class API: keyword constructor, SerializeToString,
# FromString, HasField, ...). Typed `Any`: they are built at run time.
RouteRequest: Any = _message_class("RouteRequest")
Endpoint: Any = _message_class("Endpoint")
RouteDecision: Any = _message_class("RouteDecision")
