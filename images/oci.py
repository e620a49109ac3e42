#!/usr/bin/env python3
"""Pack a root filesystem directory as a one-layer OCI image archive, reproducibly.

Contract: the same directory content (paths, bytes, modes, numeric owners, link targets) and the
same arguments give a byte-identical archive, so the same image digest. Every entry's mtime is
clamped to ``--epoch`` (SOURCE_DATE_EPOCH: files unpacked from Debian packages keep their
packaged mtimes, which Python's timestamp-checked .pyc files of the stdlib rely on), entries
are sorted by path, user and group names are dropped
(numeric owners kept: a home directory owned by the image's user stays so), the layer is gzip
with no name and mtime 0. Device nodes, sockets and FIFOs are left out, and so are the contents
of /dev, /proc, /sys and /run (the runtime mounts its own).

The archive is an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/…``) as a tar
file that ``ctr -n k8s.io image import`` and ``skopeo copy oci-archive:…`` read. The index names
the image twice: ``io.containerd.image.name`` (the full reference, which containerd uses) and
``org.opencontainers.image.ref.name`` (the tag, as the OCI layout spec expects).

Prints ``sha256:…`` — the manifest digest, i.e. the image's digest — on stdout.

Stdlib only: it runs with any Python 3.11 (the build script runs it with the system's).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import stat
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
EMPTY_DIRS = ("dev", "proc", "sys", "run")
CHUNK = 1 << 20


class OCIPackError(RuntimeError):
    """The rootfs cannot be packed; the message says which path and why."""


@dataclass(frozen=True)
class ImageConfig:
    """What goes into the OCI image config (image-spec config.md)."""

    user: str
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    workdir: str = "/"
    labels: dict[str, str] = field(default_factory=dict)
    exposed_ports: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackedImage:
    manifest_digest: str
    config_digest: str
    layer_digest: str
    diff_id: str
    layer_size: int


def _walk_sorted(root: Path, d: Path) -> Iterator[Path]:
    rel_d = d.relative_to(root).as_posix()
    for name in sorted(os.listdir(d), key=os.fsencode):
        p = d / name
        yield p
        if p.is_dir() and not p.is_symlink():
            if rel_d == "." and name in EMPTY_DIRS:
                continue
            yield from _walk_sorted(root, p)


def _tarinfo(
    root: Path, path: Path, epoch: int, seen: dict[tuple[int, int], str]
) -> tarfile.TarInfo | None:
    st = path.lstat()
    arc = path.relative_to(root).as_posix()
    ti = tarfile.TarInfo(arc)
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    ti.uname = ti.gname = ""
    ti.mtime = min(int(st.st_mtime), epoch)  # clamped: files from .debs keep theirs
    if stat.S_ISDIR(st.st_mode):
        ti.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        ti.type = tarfile.SYMTYPE
        ti.linkname = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in seen:
            ti.type = tarfile.LNKTYPE
            ti.linkname = seen[key]
        else:
            if st.st_nlink > 1:
                seen[key] = arc
            ti.type = tarfile.REGTYPE
            ti.size = st.st_size
    else:
        return None  # device nodes, sockets, FIFOs: the runtime provides /dev
    return ti


def write_layer(root: Path, out: io.BufferedIOBase, epoch: int) -> None:
    """The rootfs as one uncompressed tar stream (PAX, sorted, fixed mtimes)."""
    if not root.is_dir():
        raise OCIPackError(f"{root} is not a directory; pass the image's root filesystem")
    seen: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk_sorted(root, root):
            ti = _tarinfo(root, path, epoch, seen)
            if ti is None:
                continue
            if ti.type == tarfile.REGTYPE:
                with path.open("rb") as f:
                    tar.addfile(ti, f)
            else:
                tar.addfile(ti)


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes, counts and forwards what it is given."""

    def __init__(self, sink: io.BufferedIOBase | None) -> None:
        self.sink, self.sha, self.size = sink, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.sha.update(b)
        self.size += len(b)
        if self.sink is not None:
            self.sink.write(b)
        return len(b)


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _digest(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def pack(root: Path, archive: Path, ref: str, config: ImageConfig, epoch: int) -> PackedImage:
    """Write the OCI layout archive for `root` to `archive`; see the module docstring."""
    if ":" not in ref.rsplit("/", 1)[-1]:
        raise OCIPackError(f"image reference {ref!r} has no tag; write it as NAME:TAG")
    tag = ref.rsplit(":", 1)[1]
    with tempfile.TemporaryDirectory(prefix="oci-pack-", dir=archive.parent) as tmp:
        layer_path = Path(tmp) / "layer.tar.gz"
        with layer_path.open("wb") as raw:
            gz_hash = _Hashing(raw)
            gz_buf = io.BufferedWriter(gz_hash, CHUNK)
            with gzip.GzipFile(
                filename="", mode="wb", fileobj=gz_buf, mtime=0, compresslevel=6
            ) as gz:
                tar_hash = _Hashing(gz)  # type: ignore[arg-type]
                tar_buf = io.BufferedWriter(tar_hash, CHUNK)
                write_layer(root, tar_buf, epoch)
                tar_buf.flush()
            gz_buf.flush()
        diff_id = "sha256:" + tar_hash.sha.hexdigest()
        layer_digest = "sha256:" + gz_hash.sha.hexdigest()
        created = _rfc3339(epoch)
        cfg: dict[str, object] = {
            "created": created,
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "User": config.user,
                "Env": list(config.env),
                "Entrypoint": list(config.entrypoint) or None,
                "Cmd": list(config.cmd) or None,
                "WorkingDir": config.workdir,
                "Labels": dict(sorted(config.labels.items())),
                "ExposedPorts": {p: {} for p in config.exposed_ports},
            },
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": created, "created_by": "images/oci.py"}],
        }
        cfg_bytes = _json(cfg)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {
                "mediaType": MEDIA_CONFIG,
                "digest": _digest(cfg_bytes),
                "size": len(cfg_bytes),
            },
            "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": gz_hash.size}],
            "annotations": {"org.opencontainers.image.created": created},
        }
        man_bytes = _json(manifest)
        index = {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": _digest(man_bytes),
                    "size": len(man_bytes),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
        small = {
            "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
            "index.json": _json(index),
            f"blobs/sha256/{_digest(cfg_bytes)[7:]}": cfg_bytes,
            f"blobs/sha256/{_digest(man_bytes)[7:]}": man_bytes,
        }
        tmp_archive = archive.with_name(archive.name + ".tmp")
        with tarfile.open(tmp_archive, "w", format=tarfile.PAX_FORMAT) as out:
            for d in ("blobs", "blobs/sha256"):
                ti = tarfile.TarInfo(d)
                ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, epoch
                out.addfile(ti)
            entries = sorted([*small, f"blobs/sha256/{layer_digest[7:]}"])
            for name in entries:
                ti = tarfile.TarInfo(name)
                ti.mode, ti.mtime = 0o644, epoch
                if name in small:
                    ti.size = len(small[name])
                    out.addfile(ti, io.BytesIO(small[name]))
                else:
                    ti.size = layer_path.stat().st_size
                    with layer_path.open("rb") as f:
                        out.addfile(ti, f)
        tmp_archive.replace(archive)
    return PackedImage(_digest(man_bytes), _digest(cfg_bytes), layer_digest, diff_id, gz_hash.size)


def _rfc3339(epoch: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rootfs", type=Path)
    p.add_argument("archive", type=Path, help="the OCI archive to write (.tar)")
    p.add_argument("--ref", required=True, help="full image reference, NAME:TAG")
    p.add_argument("--user", required=True, help="UID:GID the container runs as")
    p.add_argument("--entrypoint", action="append", default=[])
    p.add_argument("--cmd", action="append", default=[])
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE (repeat)")
    p.add_argument("--workdir", default="/")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE (repeat)")
    p.add_argument("--expose", action="append", default=[], help="PORT/tcp (repeat)")
    p.add_argument("--epoch", type=int, default=None, help="default: $SOURCE_DATE_EPOCH")
    a = p.parse_args(argv)
    epoch = a.epoch if a.epoch is not None else os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None:
        p.error("set SOURCE_DATE_EPOCH or pass --epoch (the fixed mtime of every entry)")
    labels = dict(kv.split("=", 1) for kv in a.label)
    cfg = ImageConfig(
        user=a.user,
        entrypoint=tuple(a.entrypoint),
        cmd=tuple(a.cmd),
        env=tuple(a.env),
        workdir=a.workdir,
        labels=labels,
        exposed_ports=tuple(a.expose),
    )
    try:
        img = pack(a.rootfs, a.archive, a.ref, cfg, int(epoch))
    except OCIPackError as e:
        print(f"oci.py: {e}", file=sys.stderr)
        return 2
    print(img.manifest_digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
