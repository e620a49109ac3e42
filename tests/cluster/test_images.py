"""scripts/build-image.sh: the images build offline, run as a non-root user, and the same inputs
give the same digest (marker `cluster`: needs root and minutes; `make test-cluster`)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("BEAMSERVE_CACHE") or Path.home() / ".cache" / "beamserve") / "images"


def build(image: str, *args: str) -> str:
    done = subprocess.run(
        [str(REPO / "scripts" / "build-image.sh"), image, *args],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def read_archive(archive: Path) -> tuple[dict, dict, tarfile.TarFile]:
    outer = tarfile.open(archive)  # noqa: SIM115 - the layer reads from it afterwards
    index = json.load(outer.extractfile("index.json"))  # type: ignore[arg-type]
    blob = lambda d: outer.extractfile(f"blobs/sha256/{d[7:]}")  # noqa: E731
    manifest = json.load(blob(index["manifests"][0]["digest"]))  # type: ignore[arg-type]
    config = json.load(blob(manifest["config"]["digest"]))  # type: ignore[arg-type]
    gz = gzip.GzipFile(fileobj=blob(manifest["layers"][0]["digest"]))
    layer = tarfile.open(fileobj=gz)  # noqa: SIM115 - returned open
    return index, config, layer


@pytest.mark.parametrize("image", ["pause", "beamserve"])
def test_the_same_inputs_give_the_same_digest(image: str, tmp_path: Path) -> None:
    cached = build(image)  # the tier's own image (built once, cached)
    rev = (CACHE / f"{image}.rev").read_text().strip()  # the same commit, whatever HEAD is now
    again = build(image, "--rev", rev, "--no-cache", "--out", str(tmp_path))
    assert (tmp_path / f"{image}.key").read_text() == (CACHE / f"{image}.key").read_text()
    assert again == cached, (cached, again)


def test_the_chart_default_image_is_what_the_build_names() -> None:
    ref = build("beamserve").split("@")[0]
    values = yaml.safe_load((REPO / "charts" / "beamserve" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO / "charts" / "beamserve" / "Chart.yaml").read_text())
    assert ref == f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"


def test_the_image_runs_beamserve_as_user_65532() -> None:
    build("beamserve")
    _index, config, layer = read_archive(CACHE / "beamserve.oci.tar")
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Entrypoint"] == ["beamserve"]
    assert any(e.startswith("PATH=/opt/beamserve/bin:") for e in config["config"]["Env"])
    members = {m.name: m for m in layer}
    assert members["opt/beamserve/bin/beamserve"].isfile()
    home = members["home/beamserve"]
    assert (home.uid, home.gid) == (65532, 65532)
    passwd = layer.extractfile(members["etc/passwd"]).read().decode()  # type: ignore[union-attr]
    assert "beamserve:x:65532:65532:" in passwd
    # nothing left in /tmp, no apt indexes (apt's empty lock and partial/ may stay)
    lists = ("var/lib/apt/lists/lock", "var/lib/apt/lists/partial")
    assert not [n for n in members if n.startswith("tmp/")]
    assert not [n for n in members if n.startswith("var/lib/apt/lists/") and n not in lists]
    # no torch in the control-plane image
    site = [n for n in members if "/site-packages/" in n]
    assert not any("/site-packages/torch/" in n for n in site)
    # what the router needs to read a checkpoint's tokenizer and chat template
    assert any("/site-packages/tokenizers/" in n for n in site)
    assert any("/site-packages/jinja2/" in n for n in site)
