"""images/oci.py: the OCI layout writer is reproducible and writes what the spec says (fast; no
root, no network: it runs under `make test`)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[2] / "images" / "oci.py"
_spec = importlib.util.spec_from_file_location("beamserve_images_oci", _path)
assert _spec is not None and _spec.loader is not None
oci = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = oci  # dataclasses look their module up
_spec.loader.exec_module(oci)

CFG = oci.ImageConfig(user="65532:65532", entrypoint=("beamserve",), env=("A=1",))
REF = "ghcr.io/beamserve/beamserve:0.1.0"
EPOCH = 1_700_000_000


def make_rootfs(root: Path, order: list[str]) -> None:
    """The same tree, its files created in `order` (so directory order and mtimes differ)."""
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "dev").mkdir()
    for name in order:
        p = root / "usr" / "bin" / name
        p.write_text(f"#!/bin/sh\necho {name}\n")
        p.chmod(0o755)
    first = min(order)
    os.link(root / "usr" / "bin" / first, root / "usr" / "bin" / "hard")
    (root / "usr" / "bin" / "sym").symlink_to(first)
    (root / "dev" / "null-ish").write_text("left out: /dev is the runtime's\n")


def blobs(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_same_tree_same_digest_whatever_the_order_and_time(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_rootfs(a, ["x", "y", "z"])
    time.sleep(1.1)  # b's files have other mtimes
    make_rootfs(b, ["z", "y", "x"])
    img_a = oci.pack(a, tmp_path / "a.tar", REF, CFG, EPOCH)
    img_b = oci.pack(b, tmp_path / "b.tar", REF, CFG, EPOCH)
    assert img_a == img_b
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()


def test_a_changed_byte_or_mode_changes_the_digest(tmp_path: Path) -> None:
    root = tmp_path / "r"
    make_rootfs(root, ["x"])
    first = oci.pack(root, tmp_path / "1.tar", REF, CFG, EPOCH).manifest_digest
    (root / "usr" / "bin" / "x").chmod(0o700)
    second = oci.pack(root, tmp_path / "2.tar", REF, CFG, EPOCH).manifest_digest
    (root / "usr" / "bin" / "y").write_text("new")
    third = oci.pack(root, tmp_path / "3.tar", REF, CFG, EPOCH).manifest_digest
    assert len({first, second, third}) == 3


def test_layout_digests_and_layer_entries(tmp_path: Path) -> None:
    root = tmp_path / "r"
    make_rootfs(root, ["b", "a"])
    img = oci.pack(root, tmp_path / "img.tar", REF, CFG, EPOCH)
    files = blobs(tmp_path / "img.tar")
    for name, data in files.items():  # every blob is named by its sha256
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    desc = index["manifests"][0]
    assert desc["digest"] == img.manifest_digest
    assert desc["annotations"] == {
        "io.containerd.image.name": REF,
        "org.opencontainers.image.ref.name": "0.1.0",
    }
    manifest = json.loads(files[f"blobs/sha256/{img.manifest_digest[7:]}"])
    config = json.loads(files[f"blobs/sha256/{manifest['config']['digest'][7:]}"])
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Entrypoint"] == ["beamserve"]
    assert config["created"] == "2023-11-14T22:13:20Z"
    layer_gz = files[f"blobs/sha256/{manifest['layers'][0]['digest'][7:]}"]
    raw = __import__("gzip").decompress(layer_gz)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(raw).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(raw)) as layer:
        members = layer.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names, key=lambda n: n.split("/"))  # sorted, parents first
    assert "dev" in names and "dev/null-ish" not in names
    by = {m.name: m for m in members}
    assert by["usr/bin/hard"].islnk() and by["usr/bin/hard"].linkname == "usr/bin/a"
    assert by["usr/bin/sym"].issym() and by["usr/bin/sym"].linkname == "a"
    assert by["usr/bin/a"].mode == 0o755
    assert all(m.mtime <= EPOCH and m.uname == "" and m.gname == "" for m in members)


def test_a_reference_without_tag_is_refused(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    with pytest.raises(oci.OCIPackError, match="NAME:TAG"):
        oci.pack(tmp_path / "r", tmp_path / "x.tar", "ghcr.io/beamserve/beamserve", CFG, EPOCH)
