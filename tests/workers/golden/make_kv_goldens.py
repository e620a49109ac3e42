"""Produce tests/workers/golden/kv_goldens.json by running the REAL engine code.

Not part of the test run. It imports, in isolation, the exact functions and msgspec structs
from the vLLM 0.33.0 and SGLang 0.5.23 wheels and records what they output, so the tests can
check beamserve's own implementation against it without the (large) wheels:

- vLLM ``vllm/utils/hashing.py`` (sha256, sha256_cbor) and, cut out of
  ``vllm/v1/core/kv_cache_utils.py`` by name, ``init_none_hash``, ``hash_block_tokens``,
  ``get_request_block_hasher``, ``generate_block_hash_extra_keys``, ``maybe_convert_block_hash``
  … (the module itself imports half of vLLM; the cut functions only need stdlib + cbor2);
- vLLM ``vllm/distributed/kv_events.py`` whole, with its four vLLM imports stubbed: its
  ``msgspec`` structs encode the golden payloads, and its ``ZmqEventPublisher`` is run on
  loopback to record a live + replay transcript;
- SGLang ``sglang/srt/disaggregation/kv_events.py`` the same way (two imports stubbed);
- SGLang's page hash: ``mem_cache/cpp_utils/hash_binding.cpp`` compiled with g++ against
  pybind11 and OpenSSL (as torch's cpp_extension would), driven through the real
  ``native_hash.py`` and ``mem_cache/utils.py:get_hash_str`` / ``hash_str_to_int64`` /
  ``compute_node_event_hash_values``.

Run (needs g++, libssl-dev, network to PyPI):
    python3 -m venv /tmp/gold && /tmp/gold/bin/pip install msgspec cbor2 pyzmq pybind11 pydantic
    /tmp/gold/bin/pip download --no-deps vllm==0.33.0 sglang==0.5.23 -d /tmp/wheels
    /tmp/gold/bin/python tests/workers/golden/make_kv_goldens.py /tmp/wheels
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
OUT = Path(__file__).with_name("kv_goldens.json")


def extract(wheel: str, names: list[str], dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for name in names:
            zf.extract(name, dest)


def load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def cut_functions(path: Path, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Exec only the named top-level defs/assignments of a source file into namespace."""
    tree = ast.parse(path.read_text())
    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in names:
            keep.append(node)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                if isinstance(node, ast.AnnAssign) and node.value is None:
                    continue
                keep.append(node)
    found = {getattr(n, "name", None) for n in keep} | {
        t.id
        for n in keep
        if isinstance(n, ast.Assign | ast.AnnAssign)
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    missing = names - found
    assert not missing, f"not found in {path}: {missing}"
    code = compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec")
    exec(code, namespace)
    return namespace


def tokens(n: int, seed: int, vocab: int = 200_000) -> list[int]:
    return [(i * 7919 + seed * 104729) % vocab for i in range(n)]


# --- vLLM hashing --------------------------------------------------------------------------


def vllm_hash_goldens(root: Path) -> list[dict[str, Any]]:
    hashing = load_module("vllm_utils_hashing", root / "vllm/utils/hashing.py")
    import typing
    from collections.abc import Callable, Iterable, Sequence

    envs = types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
    ns: dict[str, Any] = {
        "os": os,
        "hashlib": hashlib,
        "NewType": typing.NewType,
        "Any": Any,
        "Callable": Callable,
        "Iterable": Iterable,
        "Sequence": Sequence,
        "xxhash": hashing.xxhash,
        "xxhash_cbor": hashing.xxhash_cbor,
        "envs": envs,
        "logger": logging.getLogger("vllm-golden"),
        "ExternalBlockHash": bytes | int,
    }
    cut_functions(
        root / "vllm/v1/core/kv_cache_utils.py",
        {
            "BlockHash",
            "DEFAULT_NONE_HASH_SEED",
            "_NON_CRYPTO_HASH_FUNCTIONS",
            "_NONE_HASH_SEED",
            "resolve_none_hash_seed",
            "init_none_hash",
            "hash_block_tokens",
            "maybe_convert_block_hash",
            "get_request_block_hasher",
            "generate_block_hash_extra_keys",
            "_gen_mm_extra_hash_keys",
            "_gen_lora_extra_hash_keys",
            "_gen_prompt_embeds_extra_hash_keys",
            "to_event_extra_keys",
        },
        ns,
    )
    cases: list[dict[str, Any]] = []

    def fake_request(toks: list[int], cache_salt: str | None, lora: tuple[str, str] | None) -> Any:
        lora_req = (
            types.SimpleNamespace(lora_name=lora[0], lora_path=lora[1], adapter_id=1)
            if lora
            else None
        )
        return types.SimpleNamespace(
            block_hashes=[],
            num_tokens=len(toks),
            all_token_ids=toks,
            mm_features=[],
            lora_request=lora_req,
            cache_salt=cache_salt,
            prompt_embeds=None,
        )

    def run(
        name: str,
        toks: list[int],
        block_size: int,
        algo: str,
        seed_env: str | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> None:
        old = os.environ.pop("PYTHONHASHSEED", None)
        if seed_env is not None:
            os.environ["PYTHONHASHSEED"] = seed_env
        try:
            fn = hashing.get_hash_fn_by_name(algo)
            ns["init_none_hash"](fn)
            hasher = ns["get_request_block_hasher"](block_size, fn)
            digests = hasher(fake_request(toks, cache_salt, lora))
            none_hash = ns["NONE_HASH"]
        finally:
            os.environ.pop("PYTHONHASHSEED", None)
            if old is not None:
                os.environ["PYTHONHASHSEED"] = old
        cases.append(
            {
                "name": name,
                "token_ids": toks,
                "block_size": block_size,
                "algo": algo,
                "pythonhashseed": seed_env,
                "cache_salt": cache_salt,
                "lora": list(lora) if lora else None,
                "none_hash_hex": none_hash.hex(),
                "digests_hex": [d.hex() for d in digests],
                "event_ints": [ns["maybe_convert_block_hash"](d) for d in digests],
            }
        )

    run("sha256_3_blocks_of_64_plus_tail", tokens(64 * 3 + 17, 1), 64, "sha256")
    run("sha256_block16", tokens(16 * 5, 2), 16, "sha256")
    run("sha256_short_no_full_block", tokens(63, 3), 64, "sha256")
    run("sha256_big_token_ids", [2**31 + 5, 2**40, 0, 65535] * 4, 4, "sha256")
    run("sha256_cbor_3_blocks", tokens(64 * 3, 4), 64, "sha256_cbor")
    run(
        "sha256_cbor_big_token_ids",
        [2**31 + 5, 2**40, 0, 65535, 23, 24, 255, 256] * 2,
        8,
        "sha256_cbor",
    )
    run("sha256_pythonhashseed_0", tokens(128, 5), 64, "sha256", seed_env="0")
    run("sha256_pythonhashseed_empty", tokens(64, 5), 64, "sha256", seed_env="")
    run("sha256_cache_salt", tokens(64 * 2, 6), 64, "sha256", cache_salt="tenant-a")
    run("sha256_lora", tokens(64 * 2, 7), 64, "sha256", lora=("adapter-x", "/loras/x"))
    run(
        "sha256_cbor_salt_and_lora",
        tokens(32 * 3, 8),
        32,
        "sha256_cbor",
        cache_salt="s",
        lora=("a", "/p"),
    )
    return cases


# --- SGLang hashing ------------------------------------------------------------------------


def build_sglang_native(root: Path, build: Path) -> Any:
    import pybind11

    src = root / "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = build / f"hicache_hash_cpp{suffix}"
    cmd = [
        "g++",
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-DNDEBUG",
        "-DTORCH_EXTENSION_NAME=hicache_hash_cpp",
        f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}",
        str(src),
        "-o",
        str(out),
        "-lcrypto",
        "-Wno-deprecated-declarations",
    ]
    subprocess.run(cmd, check=True)
    return load_module("hicache_hash_cpp", out)


def sglang_hash_goldens(root: Path, build: Path) -> list[dict[str, Any]]:
    native = build_sglang_native(root, build)
    native_hash = load_module(
        "sglang_native_hash", root / "sglang/srt/mem_cache/cpp_utils/native_hash.py"
    )
    native_hash._load_native_hash_module = lambda: native  # the compiled real extension
    ns: dict[str, Any] = {
        "hashlib": hashlib,
        "Any": Any,
        "List": list,
        "Optional": typing_optional(),
        "get_native_hash": native_hash.get_native_hash,
    }
    cut_functions(
        root / "sglang/srt/mem_cache/utils.py",
        {
            "get_hash_str",
            "hash_str_to_int64",
            "storage_namespace_seed",
            "get_storage_hash_str",
            "compute_node_hash_values",
            "compute_node_event_hash_values",
        },
        ns,
    )

    class Key:
        def __init__(self, toks: list[int], cache_salt: str | None) -> None:
            self.token_ids = toks
            self.extra_key = None
            self.cache_salt = cache_salt
            self.is_bigram = False

        def __len__(self) -> int:
            return len(self.token_ids)

    cases: list[dict[str, Any]] = []

    def run(name: str, toks: list[int], page_size: int, cache_salt: str | None = None) -> None:
        root_node = types.SimpleNamespace(
            parent=None, key=Key([], None), hash_value=[], event_hash_value=None
        )
        node = types.SimpleNamespace(
            parent=root_node,
            key=Key(toks, cache_salt),
            hash_value=None,
            event_hash_value=None,
        )
        hexes = ns["compute_node_event_hash_values"](node, page_size)
        cases.append(
            {
                "name": name,
                "token_ids": toks,
                "page_size": page_size,
                "cache_salt": cache_salt,
                "digests_hex": list(hexes),
                "event_ints": [ns["hash_str_to_int64"](h) for h in hexes],
            }
        )

    run("pages_of_64_with_partial_tail", tokens(64 * 2 + 10, 1), 64)
    run("page_size_1", tokens(5, 2), 1)
    run("page_size_16_exact", tokens(48, 3), 16)
    run("wide_token_in_second_page", [1, 2, 3, 4, 5, 2**32, 7, 8, 9, 10], 4)
    run("wide_token_max_int64", [2**63 - 1, 0, 1], 2)
    run("uint32_max_is_not_wide", [2**32 - 1, 0, 1, 2], 4)
    run("salted", tokens(64 + 3, 4), 64, cache_salt="tenant-a")
    return cases


def typing_optional() -> Any:
    import typing

    return typing.Optional


# --- event payloads ------------------------------------------------------------------------


def stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load_vllm_kv_events(root: Path) -> types.ModuleType:
    @dataclasses.dataclass
    class KVEventsConfig:
        enable_kv_cache_events: bool = False
        publisher: str | None = None
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    for pkg in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"):
        stub(pkg)
    stub("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=lambda p: (p.split("://")[0], *p.split("://")[1].rsplit(":", 1)),
    )
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return load_module("vllm.distributed.kv_events", root / "vllm/distributed/kv_events.py")


class NetworkAddress:
    """Just enough of sglang.srt.utils.network.NetworkAddress for loopback tcp."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port, self.is_ipv6 = host, port, ":" in host

    @classmethod
    def parse(cls, s: str) -> NetworkAddress:
        host, port = s.rsplit(":", 1)
        return cls(host.strip("[]"), int(port))

    def to_tcp(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def load_sglang_kv_events(root: Path) -> types.ModuleType:
    for pkg in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"):
        stub(pkg)
    stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    stub("sglang.srt.utils.network", NetworkAddress=NetworkAddress)
    return load_module(
        "sglang.srt.disaggregation.kv_events", root / "sglang/srt/disaggregation/kv_events.py"
    )


def from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__bytes__"}:
        return bytes.fromhex(value["__bytes__"])
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


BIG = 2**64 - 1
VLLM_BATCHES: list[dict[str, Any]] = [
    {
        "name": "full_attention_stored",
        "ts": 1764432000.125,
        "dp_rank": 0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [6087411162821728317, BIG, 0],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ],
    },
    {
        "name": "window_stored_and_removed",
        "ts": 1764432000.5,
        "dp_rank": 1,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [2**63, 12345],
                "parent_block_hash": 2**63 - 1,
                "token_ids": [70000, 2**31, 127, 128, 255, 256, 65535, 65536],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 1,
                "kv_cache_spec_kind": "sliding_window",
                "kv_cache_spec_sliding_window": 512,
                "session_id": "sess-1",
            },
            {"type": "BlockRemoved", "block_hashes": [12345], "medium": "GPU", "group_idx": 1},
            {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": None},
            {"type": "AllBlocksCleared"},
        ],
    },
    {
        "name": "every_field",
        "ts": 1.0,
        "dp_rank": 3,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [11, 22],
                "parent_block_hash": 7,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": 7,
                "medium": "CPU",
                "lora_name": "adapter-ü",
                "extra_keys": [["adapter-ü", ["mm-1", 0], "salt"], None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
                "kv_cache_spec_sliding_window": None,
                "locality": "LOCAL",
                "ownership": "tier-2",
                "session_id": "s" * 40,
                "lookahead_token_ids": [[5], [6]],
            },
            {
                "type": "BlockRemoved",
                "block_hashes": [11],
                "medium": "STORAGE",
                "group_idx": 0,
                "locality": "REMOTE",
                "ownership": "tier-2",
            },
        ],
    },
    {
        "name": "bytes_hashes",
        "ts": 1764432001.0,
        "dp_rank": 0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [{"__bytes__": "ab" * 32}],
                "parent_block_hash": {"__bytes__": "01" * 32},
                "token_ids": [9, 9],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ],
    },
    {"name": "no_dp_rank_empty", "ts": 0.0, "dp_rank": None, "events": []},
]

SGLANG_BATCHES: list[dict[str, Any]] = [
    {
        "name": "stored_full",
        "ts": 1764432000.125,
        "dp_rank": 0,
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [-96911884851298857],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3],
                "block_size": 3,
                "lora_id": None,
                "medium": "GPU",
                "cache_salt": "tenant-a",
                "session_id": "sess",
                "lora_name": "adapter",
            },
            {
                "type": "BlockStored",
                "block_hashes": [2**63 - 1],
                "parent_block_hash": -(2**63),
                "token_ids": [4],
                "block_size": 1,
                "lora_id": None,
            },
        ],
    },
    {
        "name": "removed_cleared_no_rank",
        "ts": 2.5,
        "dp_rank": None,
        "events": [
            {"type": "BlockRemoved", "block_hashes": [-1, 1], "medium": "CPU_PINNED"},
            {"type": "BlockRemoved", "block_hashes": [5]},
            {"type": "AllBlocksCleared"},
        ],
    },
]


def build_events(mod: types.ModuleType, events: list[dict[str, Any]]) -> list[Any]:
    out = []
    for ev in events:
        fields = {k: from_json(v) for k, v in ev.items() if k != "type"}
        if "extra_keys" in fields and fields["extra_keys"] is not None:
            fields["extra_keys"] = [
                None if k is None else tuple(tuple(x) if isinstance(x, list) else x for x in k)
                for k in fields["extra_keys"]
            ]
        out.append(getattr(mod, ev["type"])(**fields))
    return out


def payload_goldens(
    mod: types.ModuleType, batches: list[dict[str, Any]], rank_field: str
) -> list[dict[str, Any]]:
    import msgspec

    enc = msgspec.msgpack.Encoder()
    out = []
    for b in batches:
        batch = mod.KVEventBatch(ts=b["ts"], events=build_events(mod, b["events"]))
        setattr(batch, rank_field, b["dp_rank"])
        payload = enc.encode(batch)
        # Round trip through the engine's own typed decoder, as its consumers would (nested
        # tuples inside ``Any`` come back as lists, so compare re-encoded bytes).
        decoded = msgspec.msgpack.Decoder(mod.KVEventBatch).decode(payload)
        assert enc.encode(decoded) == payload, (decoded, batch)
        out.append({**b, "payload_hex": payload.hex()})
    return out


def publisher_transcript(
    mod: types.ModuleType, batches: list[dict[str, Any]], rank_field: str, **kwargs: Any
) -> dict[str, Any]:
    """Run the engine's real ZmqEventPublisher; record live frames and a replay from seq 1."""
    import zmq

    pub = mod.ZmqEventPublisher(topic="kv-events", buffer_steps=2, **kwargs)
    ctx = zmq.Context.instance()
    live: list[list[str]] = []
    replay: list[list[str]] = []
    try:
        endpoint = pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay_endpoint = pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.setsockopt(zmq.RCVTIMEO, 3000)
        sub.connect(endpoint)
        time.sleep(0.5)  # PUB/SUB slow joiner
        for b in batches:
            batch = mod.KVEventBatch(ts=b["ts"], events=build_events(mod, b["events"]))
            setattr(batch, rank_field, b["dp_rank"])
            pub.publish(batch)
        for _ in batches:
            live.append([f.hex() for f in sub.recv_multipart()])
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 3000)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        while True:
            frames = dealer.recv_multipart()
            replay.append([f.hex() for f in frames])
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
        sub.close(0)
        dealer.close(0)
    finally:
        pub.shutdown()
    return {
        "topic": "kv-events",
        "buffer_steps": 2,
        "batches": batches,
        "live_frames_hex": live,
        "replay_from_seq": 1,
        "replay_frames_hex": replay,
    }


def main() -> None:
    wheels = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/x")
    vllm_whl = glob.glob(str(wheels / f"vllm-{VLLM_VERSION}-*.whl"))[0]
    sgl_whl = glob.glob(str(wheels / f"sglang-{SGLANG_VERSION}-*.whl"))[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        extract(
            vllm_whl,
            [
                "vllm/utils/hashing.py",
                "vllm/v1/core/kv_cache_utils.py",
                "vllm/distributed/kv_events.py",
            ],
            root,
        )
        extract(
            sgl_whl,
            [
                "sglang/srt/mem_cache/utils.py",
                "sglang/srt/mem_cache/cpp_utils/native_hash.py",
                "sglang/srt/mem_cache/cpp_utils/hash_binding.cpp",
                "sglang/srt/disaggregation/kv_events.py",
            ],
            root,
        )
        vllm_mod = load_vllm_kv_events(root)
        sgl_mod = load_sglang_kv_events(root)
        import msgspec

        result = {
            "generated_by": "tests/workers/golden/make_kv_goldens.py",
            "vllm_version": VLLM_VERSION,
            "sglang_version": SGLANG_VERSION,
            "msgspec_version": msgspec.__version__,
            "vllm_hash": vllm_hash_goldens(root),
            "sglang_hash": sglang_hash_goldens(root, root),
            "vllm_payloads": payload_goldens(vllm_mod, VLLM_BATCHES, "data_parallel_rank"),
            "sglang_payloads": payload_goldens(sgl_mod, SGLANG_BATCHES, "attn_dp_rank"),
            "vllm_transcript": publisher_transcript(
                vllm_mod,
                VLLM_BATCHES[:4],
                "data_parallel_rank",
                data_parallel_rank=0,
                endpoint="tcp://*:0",
                replay_endpoint="tcp://*:0",
            ),
            "sglang_transcript": publisher_transcript(
                sgl_mod,
                SGLANG_BATCHES,
                "attn_dp_rank",
                attn_dp_rank=0,
                endpoint="tcp://127.0.0.1:0",
                replay_endpoint="tcp://127.0.0.1:0",
                bind=True,
            ),
        }
    OUT.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
