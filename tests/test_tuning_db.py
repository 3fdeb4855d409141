"""Tuning database: lookup order, nearest bucket, corruption, concurrent writers."""

import contextlib
import json
import multiprocessing as mp
import os

import pytest
import torch

import tpukernels as tk
from tpukernels.autotune import db
from kernels_for_tests import scale
from tpukernels.lowering import specs_from_values


def _specs(n, cols=128):
    return specs_from_values(scale, [torch.zeros(n, cols), 2.0])


def test_dispatch_order_explicit_user_db_nearest_default(tmp_cache, monkeypatch):
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v6e")
    specs, statics = _specs(1024)
    assert scale.resolve_config(specs, statics, None) == (tk.Config(block_rows=16), "default")
    db.record(scale, "v6e", specs, statics, {"block_rows": 256}, {"evaluator": "test"})
    assert scale.resolve_config(specs, statics, None) == (tk.Config(block_rows=256), "user-db:v6e")
    # 2000 rows: another bucket, same dtypes/statics -> nearest entry
    s2, _ = _specs(2000)
    cfg, source = scale.resolve_config(s2, statics, None)
    assert cfg == {"block_rows": 256} and source == "user-db:nearest:v6e"
    # different static value: a miss -> default
    s3, st3 = specs_from_values(scale, [torch.zeros(1024, 128), 3.0])
    assert scale.resolve_config(s3, st3, None)[1] == "default"
    # explicit beats everything
    assert scale.resolve_config(specs, statics, {"block_rows": 8}) == (tk.Config(block_rows=8), "explicit")
    # another chip has no data
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v5e")
    assert scale.resolve_config(specs, statics, None)[1] == "default"


def test_corrupted_file_warns_and_is_ignored(tmp_cache, monkeypatch):
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v6e")
    path = db.user_db_path(scale.qualname, "v6e")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write('{"version": 1, "entries": [')
    specs, statics = _specs(64)
    with pytest.warns(RuntimeWarning, match="corrupted tuning file"):
        assert scale.resolve_config(specs, statics, None)[1] == "default"
    # a write moves the corrupted file aside instead of destroying it
    with pytest.warns(RuntimeWarning, match="kept the unreadable tuning file"):
        db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"})
    assert os.path.exists(path + ".corrupt")
    assert json.load(open(path))["entries"][0]["config"] == {"block_rows": 32}


def test_stale_source_hash_is_skipped(tmp_cache, monkeypatch):
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v6e")
    specs, statics = _specs(64)
    path = db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"})
    data = json.load(open(path))
    data["entries"][0]["key"]["source_hash"] = "0" * 16
    json.dump(data, open(path, "w"))
    with pytest.warns(RuntimeWarning, match=r"has 1 entry made for an earlier version of the kernel's source"):
        assert scale.resolve_config(specs, statics, None)[1] == "default"
    import warnings

    with warnings.catch_warnings():  # said once per kernel, chip and source, not on every lookup
        warnings.simplefilter("error", RuntimeWarning)
        assert scale.resolve_config(specs, statics, None)[1] == "default"


def _writer(args):
    cache, i = args
    os.environ["TPUKERNELS_CACHE_DIR"] = cache
    from kernels_for_tests import scale as k
    from tpukernels.autotune import db as d

    specs, statics = specs_from_values(k, [torch.zeros(8 * (i + 1), 128), float(i)])
    d.record(k, "v5e", specs, statics, {"block_rows": 8}, {"evaluator": "test", "i": i})


def test_concurrent_writers_lose_nothing(tmp_cache):
    with mp.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(str(tmp_cache), i) for i in range(12)])
    data = json.load(open(db.user_db_path(scale.qualname, "v5e")))
    assert sorted(e["evidence"]["i"] for e in data["entries"]) == list(range(12))


@pytest.mark.aot
def test_compile_for_uses_the_target_chips_tuning_data(tmp_cache, monkeypatch):
    monkeypatch.delenv("TPUKERNELS_TARGET_CHIP", raising=False)
    specs, statics = _specs(2048, 256)
    db.record(scale, "tpu7x", specs, statics, {"block_rows": 256}, {"evaluator": "test"})
    r7 = tk.compile_for(scale, "tpu7x", "2048x256:f32", alpha=2.0)
    r5 = tk.compile_for(scale, "v5e", "2048x256:f32", alpha=2.0)
    assert r7.ok and r7.config == {"block_rows": 256} and r7.config_source == "user-db:tpu7x"
    assert r5.ok and r5.config_source == "default"


def _write_raw(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data))


def test_entries_of_the_wrong_schema_are_warnings_not_crashes(tmp_cache, monkeypatch):
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v6e")
    specs, statics = _specs(64)
    good = db.entry_key(scale, specs, statics)
    path = db.user_db_path(scale.qualname, "v6e")
    _write_raw(path, {"version": 1, "entries": ["oops", {"key": "str", "config": {}}, {"key": {}, "config": 3},
                                                 {"key": {**good, "shapes": "x"}, "config": {"block_rows": 8}},
                                                 {"key": good, "config": {"block_rows": 32}}]})
    with pytest.warns(RuntimeWarning, match="malformed entry"):
        assert scale.resolve_config(specs, statics, None) == (tk.Config(block_rows=32), "user-db:v6e")
    x = torch.randn(64, 128)
    torch.testing.assert_close(scale(x, 2.0), 2 * x)  # the call uses the good entry (warned once per file)


@pytest.mark.parametrize("bad", ["128", 0, -8, 12])
def test_a_bad_value_in_a_matching_entry_falls_back(tmp_cache, monkeypatch, bad):
    """A DB value of the wrong type, zero/negative, or one the launch rejects: a warning and the default."""
    monkeypatch.setenv("TPUKERNELS_TARGET_CHIP", "v6e")
    specs, statics = _specs(64)
    path = db.user_db_path(scale.qualname, "v6e")
    _write_raw(path, {"version": 1, "entries": [{"key": db.entry_key(scale, specs, statics),
                                                 "config": {"block_rows": bad}}]})
    scale._entries.clear(), scale._plans.clear()
    x = torch.randn(64, 128)
    with pytest.warns(RuntimeWarning, match="ignoring"):
        out = scale(x, 2.0)
    torch.testing.assert_close(out, 2 * x)
    scale._entries.clear(), scale._plans.clear()


def test_a_second_corruption_never_overwrites_the_first_copy(tmp_cache):
    specs, statics = _specs(64)
    path = db.user_db_path(scale.qualname, "v6e")
    for text in ("first broken file", "second broken file"):
        _write_raw(path, text)
        with pytest.warns(RuntimeWarning, match="kept the unreadable"):
            db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"})
    assert open(path + ".corrupt").read() == "first broken file"
    assert open(path + ".corrupt.1").read() == "second broken file"


def test_orphan_temporary_files_are_cleaned_and_modes_kept(tmp_cache):
    specs, statics = _specs(64)
    path = db.user_db_path(scale.qualname, "v6e")
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    orphan = os.path.join(folder, f".tmp-{os.path.basename(path)}-killed.json")
    other = os.path.join(folder, ".tmp-another.json-x.json")  # another kernel's writer may own this one
    for f in (orphan, other):
        _write_raw(f, "{")
    old = os.umask(0o022)
    try:
        db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"})
    finally:
        os.umask(old)
    assert not os.path.exists(orphan) and os.path.exists(other)
    assert os.stat(path).st_mode & 0o777 == 0o644  # not mkstemp's 0600
    os.chmod(path, 0o664)
    db.record(scale, "v6e", specs, statics, {"block_rows": 16}, {"evaluator": "test"})
    assert os.stat(path).st_mode & 0o777 == 0o664  # an existing file keeps its mode


# ---------------------------------------------------------------------------------- unwritable cache (issue 36)
@contextlib.contextmanager
def _unprivileged():
    """Root writes into 0555 folders anyway: as root, run the block with effective uid/gid ``nobody`` (the
    real and saved ids stay 0, so they come back after); as another user, nothing to do."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_record_into_a_read_only_cache_dir_warns_once_and_goes_on(monkeypatch):
    """Issue 36 item 9: a read-only cache folder (chmod 0555, written as a user without rights to it) made
    filelock's lock file raise ``PermissionError`` out of ``record()``. Now: no exception, one RuntimeWarning
    for two writes, None returned, nothing created in the folder; ``errors="raise"`` still raises; a sweep with
    ``write_db="user"`` keeps its best config and says why it was not stored."""
    import shutil
    import tempfile
    import warnings

    from test_autotune_helpers import SyntheticEvaluator
    from tpukernels.autotune.tuner import tune

    root = tempfile.mkdtemp(prefix="tk-ro-cache-")  # not under pytest's 0700 tmp_path: `nobody` must reach it
    folder = os.path.join(root, "cache", "autotuning", "v6e")
    os.makedirs(folder)
    for d in (root, os.path.join(root, "cache"), os.path.dirname(folder), folder):
        os.chmod(d, 0o755 if d == root else 0o555)
    monkeypatch.delenv("TPUKERNELS_TARGET_CHIP", raising=False)
    monkeypatch.setattr(db, "_WARNED_UNWRITABLE", set(), raising=False)
    specs, statics = _specs(64)
    # the same calls once into a writable cache: as `nobody` this process cannot import what they import lazily
    # (the interpreter's stdlib may sit under root's 0700 home)
    monkeypatch.setenv("TPUKERNELS_CACHE_DIR", os.path.join(root, "warm"))
    assert db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"})
    tune(scale, "64x128:f32", 2.0, evaluator=SyntheticEvaluator(), strategy="exhaustive", write_db="user")
    monkeypatch.setenv("TPUKERNELS_CACHE_DIR", os.path.join(root, "cache"))
    try:
        with _unprivileged():
            if os.access(folder, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
                pytest.skip("this user can write to a 0555 folder")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first = db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"})
                second = db.record(scale, "v6e", specs, statics, {"block_rows": 16}, {"evaluator": "test"})
            with pytest.raises(PermissionError):
                db.record(scale, "v6e", specs, statics, {"block_rows": 8}, {"evaluator": "test"}, errors="raise")
            r = tune(scale, "64x128:f32", 2.0, evaluator=SyntheticEvaluator(), strategy="exhaustive",
                     write_db="user")
        assert first is None and second is None
        msgs = [f"{w.category.__name__}: {w.message}" for w in caught]
        assert len(msgs) == 1, msgs
        assert msgs[0].startswith("RuntimeWarning: tpukernels: cannot write the tuning DB file")
        assert "PermissionError" in msgs[0] and folder in msgs[0]
        assert os.listdir(folder) == []
        assert r.best is not None and r.db_path is None and "cannot write" in r.db_note
    finally:
        for d, _, _ in os.walk(root):
            os.chmod(d, 0o755)
        shutil.rmtree(root, ignore_errors=True)


def test_record_unwritable_warning_is_per_folder(tmp_cache, monkeypatch):
    """In process (any user): an OSError from the lock (simulated) is one warning per folder, then debug logs;
    another folder warns again; the history writer behaves the same; a bad ``errors`` is an ArgumentError."""
    import warnings

    from filelock import FileLock

    from tpukernels.errors import ArgumentError

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", self.lock_file)

    monkeypatch.setattr(FileLock, "acquire", refuse)
    monkeypatch.setattr(db, "_WARNED_UNWRITABLE", set(), raising=False)
    specs, statics = _specs(64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"}) is None
        assert db.record(scale, "v6e", specs, statics, {"block_rows": 16}, {"evaluator": "test"}) is None
        assert db.record(scale, "v5e", specs, statics, {"block_rows": 16}, {"evaluator": "test"}) is None
        assert db.record_history(scale, "v6e", specs, statics, "ev", [({"block_rows": 8}, 1.0)]) is None
        assert db.record_history(scale, "v6e", specs, statics, "ev", [({"block_rows": 8}, 1.0)]) is None
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 3, msgs
    assert "autotuning/v6e/" in msgs[0] and "autotuning/v5e/" in msgs[1] and "tuning history" in msgs[2]
    assert not os.path.exists(db.user_db_path(scale.qualname, "v6e"))
    with pytest.raises(PermissionError):
        db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"}, errors="raise")
    with pytest.raises(ArgumentError, match="errors must be 'warn' or 'raise'"):
        db.record(scale, "v6e", specs, statics, {"block_rows": 32}, {"evaluator": "test"}, errors="ignore")
