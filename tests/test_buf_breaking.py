"""`buf breaking` against the released contract (protos/baseline.binpb), as `make lint` runs it: the
tree passes, and a copy of it with a wire-incompatible change is caught."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "protos" / "baseline.binpb"
BUF = Path(sys.executable).parent / "buf"


def breaking(tree: Path) -> subprocess.CompletedProcess:
    assert BUF.exists(), "buf-bin is a dev dependency"
    return subprocess.run([str(BUF), "breaking", str(tree), "--against", str(BASELINE)],
                          capture_output=True, text=True, timeout=120, cwd=tree)


def test_the_baseline_is_an_image_of_the_contract():
    # A buf image reads as a FileDescriptorSet (its extra fields are unknown fields).
    image = descriptor_pb2.FileDescriptorSet.FromString(BASELINE.read_bytes())
    files = {f.name: f for f in image.file}
    assert {s.name for s in files["refit_grpc/v1/refit.proto"].service} == {"RefitService"}
    assert "buf breaking --against $(PROTO_BASELINE)" in (ROOT / "Makefile").read_text()


def test_the_tree_is_compatible_with_the_released_contract():
    out = breaking(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_renumbered_field_is_caught(tmp_path):
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "protos" / "refit_grpc", tmp_path / "protos" / "refit_grpc")
    proto = tmp_path / "protos" / "refit_grpc" / "v1" / "refit.proto"
    text = proto.read_text()
    field = "  // Must be greater than the applied version.\n  int64 version = 1;"  # UpdateWeights'
    assert text.count(field) == 1
    proto.write_text(text.replace(field, field.replace("= 1;", "= 99;")))
    out = breaking(tmp_path)
    assert out.returncode != 0
    assert 'Previously present field "1" with name "version"' in out.stdout + out.stderr, out
