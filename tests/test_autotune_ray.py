"""Autotune sweeps on a real local Ray cluster: same winner as the process pool on the same candidates, a
crashing and a hanging candidate fail only their own task, several sweeps share one cluster, the CLI."""

import json
import os
import time

import pytest

from test_autotune_helpers import SyntheticEvaluator, key, tiles
from tpukernels.autotune.executors import ProcessExecutor, RayExecutor
from tpukernels.autotune.tuner import tune
from tpukernels.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
HELPERS = os.path.join(HERE, "test_autotune_helpers.py")
OPT = {"a": 32, "b": 512, "c": 4}
SMALL = {"a": [8, 32], "b": [256, 512], "c": [2, 4]}  # with the defaults (16, 256, 1): 3 x 2 x 3 configs


@pytest.fixture(scope="module")
def cluster():
    import ray

    ex = RayExecutor(2, imports=[HELPERS])
    ex.start()
    assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 2
    yield ex
    ex.shutdown()
    assert not ray.is_initialized()


def _table(r):
    return {key(**t.config): (t.status, t.time_us) for t in r.trials}


def test_ray_sweep_finds_the_process_pools_winner(cluster):
    ev = SyntheticEvaluator(optimum=OPT)
    t0 = time.monotonic()
    on_ray = tune(tiles, "256x128:f32", evaluator=ev, strategy="exhaustive", values=SMALL, executor=cluster)
    assert time.monotonic() - t0 < 300  # no hang (a bound, not a speed target: ~10 s when quiet)
    with ProcessExecutor(2, imports=[HELPERS]) as pool:
        in_procs = tune(tiles, "256x128:f32", evaluator=ev, strategy="exhaustive", values=SMALL, executor=pool)
    assert on_ray.best.config == in_procs.best.config == OPT
    assert _table(on_ray) == _table(in_procs) and len(on_ray.trials) == 18
    pids = {t.details["pid"] for t in on_ray.trials}
    assert os.getpid() not in pids and not pids & {t.details["pid"] for t in in_procs.trials}


@pytest.mark.slow  # ~90 s (a hang waits out its timeout); make test keeps the process pool's crash + hang test
def test_a_crash_and_a_hang_fail_only_their_task(cluster):
    crash, hang = key(a=16, b=256, c=2), key(a=8, b=256, c=1)
    ev = SyntheticEvaluator(optimum=OPT, crash=(crash,), hang=(hang,), hang_s=600, sleep_s=0.2)
    t0 = time.monotonic()
    # 0.2 s candidates; a 45 s timeout leaves room on a machine loaded by libtpu estimates (20 s was not enough
    # there: three candidates timed out), and the hang (600 s) is killed at it
    r = tune(tiles, "256x128:f32", evaluator=ev, strategy="exhaustive", values={"a": [8], "b": [256], "c": [2, 3]},
             executor=cluster, candidate_timeout_s=45)
    assert time.monotonic() - t0 < 400  # the hang was killed at its timeout, not run out
    by = {key(**t.config): t for t in r.trials}
    assert by[crash].status == "crashed" and "WorkerCrashedError" in by[crash].error
    assert by[hang].status == "timeout"
    assert r.failures == {"crashed": 1, "timeout": 1} and len(r.ok_trials) == 4
    # the pool was not restarted: candidates in flight beside the crash and the hang still finished
    assert not any(t.status in ("cancelled",) for t in r.trials)


@pytest.mark.slow  # ~30 s
def test_concurrent_sweeps_share_the_cluster(cluster):
    import concurrent.futures as cf

    optima = [OPT, {"a": 8, "b": 2048, "c": 1}, {"a": 128, "b": 128, "c": 5}]

    def sweep(opt):
        with cluster.share() as handle:
            assert 1 <= handle.slots <= 2
            return tune(tiles, "256x128:f32", evaluator=SyntheticEvaluator(optimum=opt), strategy="coordinate",
                        executor=handle)

    with cf.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(sweep, optima))
    assert [r.best.config for r in results] == optima
    assert cluster.slots == 2  # every handle closed


@pytest.mark.slow  # ~45 s: the CLI's Ray path; the executor itself is tested above
@pytest.mark.aot
def test_cli_library_kernels_times_chips_on_ray(monkeypatch, tmp_cache, capsys):
    from tpukernels import library
    from tpukernels.dsl.kernel import REGISTRY

    rms, mm = REGISTRY["tpukernels::rms_norm_fwd"], REGISTRY["tpukernels::matmul_nn"]
    monkeypatch.setattr(library, "standard_cases", lambda: [
        (rms, ("512x1024:bf16", None, 1e-6, 0.0, "llama", False), {}),
        (mm, ("1x512x512:bf16", "1x512x512:bf16"), {})])
    t0 = time.monotonic()
    rc = main(["autotune", "--library", "--chip", "v5e,tpu7x", "--no-cycles", "--budget", "2", "--seconds", "150",
               "--executor", "ray", "--workers", "2", "--write-db", "--json", "--no-progress"])
    assert rc == 0 and time.monotonic() - t0 < 150
    res = json.loads(capsys.readouterr().out)  # kernels x chips, in order; they ran at once on the cluster
    assert [(r["kernel"], r["chip"]) for r in res] == [
        ("tpukernels::rms_norm_fwd", "v5e"), ("tpukernels::rms_norm_fwd", "tpu7x"),
        ("tpukernels::matmul_nn", "v5e"), ("tpukernels::matmul_nn", "tpu7x")]
    assert all(r["evaluated"] == 2 and r["ok"] >= 1 and r["label"] == "model" for r in res)
    assert all(r["db_path"].endswith(f"{r['chip']}/{r['kernel'].replace('::', '.')}.json") for r in res)
    assert all(t["details"]["pid"] != os.getpid() for r in res for t in r["trials"])


def test_cli_refuses_ray_with_measure_and_address_without_ray(capsys):
    base = ["--import", HELPERS, "autotune", "tktest_autotune::tiles", "--shape", "64x128:f32", "--no-progress"]
    assert main([*base, "--evaluator", "measure", "--executor", "ray"]) == 2
    assert "measure evaluator times them one at a time" in capsys.readouterr().err
    assert main([*base, "--chip", "v5e", "--address", "auto"]) == 2
    assert "--address names a Ray cluster" in capsys.readouterr().err


@pytest.mark.slow  # ~20 s
def test_executor_bench_rows_and_report(cluster):
    from tpukernels.bench.executors import run
    from tpukernels.bench.report import _host_section

    rows = run(workers=2, kinds=("inline", "ray"), sweeps=("overhead",), log=lambda m: None)
    assert [(r["executor"], r["candidates"], r["ok"]) for r in rows] == [("inline", 120, 120), ("ray", 120, 120)]
    assert all(r["candidates_per_s"] == pytest.approx(r["candidates"] / r["seconds"], rel=0.01) for r in rows)
    md = "\n".join(_host_section({"rows": [dict(r, what="executors") for r in rows], "kind": "measured",
                                  "versions": {}, "created": "now"}))
    assert "| ray | 2 | overhead | 120 |" in md and "| inline | 1 | overhead | 120 |" in md


def test_a_candidates_timeout_counts_from_its_start_or_the_startup_allowance():
    """A task reports its start after its worker's imports; one that never reports (hung imports) is timed
    from the end of ``startup_timeout_s`` after submission, so it cannot hang the sweep."""
    import concurrent.futures as cf

    ex = RayExecutor(2, startup_timeout_s=300)
    ex._polled = time.monotonic() + 3600  # no board poll (no cluster in this test)
    started, pending, hung = cf.Future(), cf.Future(), cf.Future()
    ex._jobs = {started: 1, pending: 2, hung: 3}
    ex._started = {1: 123.0}
    now = time.monotonic()
    assert ex.running_since(started, now - 1000) == 123.0
    assert ex.running_since(pending, now - 10) is None  # importing: not yet timed
    since = ex.running_since(hung, now - 400)
    assert since == pytest.approx(now - 400 + 300)


def test_a_sweep_survives_a_lost_worker(cluster, tmp_path):
    """A Ray worker killed from outside mid-candidate (SIGKILL, as the OOM killer or a lost node would): Ray
    re-runs its task on a fresh worker (task ``max_retries``), the sweep finishes and every candidate has its
    result: none crashed, none lost, the same table as an undisturbed sweep."""
    import concurrent.futures as cf
    import signal

    marks = tmp_path / "marks"
    marks.mkdir()
    ev = SyntheticEvaluator(optimum=OPT, sleep_s=1.0, mark_dir=str(marks))
    few = {"a": [8], "b": [256], "c": [2, 3]}  # with the defaults (16, 256, 1): 2 x 1 x 3 configs
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(tune, tiles, "256x128:f32", evaluator=ev, strategy="exhaustive", values=few,
                          executor=cluster, candidate_timeout_s=120)
        victim = None
        while victim is None and time.monotonic() - t0 < 120:  # the first candidate that starts
            time.sleep(0.05)
            started = sorted(marks.iterdir(), key=lambda p: p.stat().st_mtime)
            if started:
                victim = started[0].name
        assert victim is not None, "no candidate started within 120 s"
        pid = int(victim.rsplit("-", 1)[1])
        assert pid != os.getpid()  # a worker of the cluster this test started, never this process
        os.kill(pid, signal.SIGKILL)
        r = fut.result(timeout=300)
    assert time.monotonic() - t0 < 300
    lost = victim.rsplit("-", 1)[0]
    reruns = [p.name for p in marks.iterdir() if p.name.rsplit("-", 1)[0] == lost]
    assert len(reruns) == 2 and str(pid) in {n.rsplit("-", 1)[1] for n in reruns}  # re-run on another worker
    assert len(r.trials) == 6 and r.failures == {} and all(t.ok for t in r.trials)
    undisturbed = tune(tiles, "256x128:f32", evaluator=SyntheticEvaluator(optimum=OPT), strategy="exhaustive",
                       values=few, executor="inline")
    assert _table(r) == _table(undisturbed) and r.best.config == {"a": 16, "b": 256, "c": 3}
