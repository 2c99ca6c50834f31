from pathlib import Path

import pytest
from persia_nats.common.cpu_policy import NATS_SERVER_GO_ENV
from persia_nats.common.errors import ConfigError

from persia.launcher import main, nats_server_exec, procfile

ROOT = Path(__file__).resolve().parents[2]


def test_procfile_has_every_replica_with_its_index():
    text = procfile(2, 3, 2, 2, "train.py", "loader.py")
    lines = [x for x in text.splitlines() if not x.startswith("#")]
    names = [x.split(":")[0] for x in lines]
    assert names == ["nats", "ps0", "ps1", "ps2", "embedding_worker0", "embedding_worker1", "nn_worker",
                     "data_loader0", "data_loader1"]
    assert "--replica-index 2 --replica-size 3" in lines[3]
    assert "nn-worker train.py --nproc-per-node 2" in lines[6]
    assert all(x.split(": ", 1)[1].startswith("exec ") for x in lines)
    # the sparse roles yield the shared cores to the NN worker unless .env says otherwise
    yielding = [x.split(":")[0] for x in lines if 'PERSIA_CPU_POLICY="${PERSIA_CPU_POLICY:-idle}"' in x]
    assert yielding == ["ps0", "ps1", "ps2", "embedding_worker0", "embedding_worker1", "data_loader0", "data_loader1"]


def test_both_procfiles_run_nats_server_with_the_go_runtime_settings():
    """The committed Procfile's nats line and a generated one's start the same way: GOGC and GOMEMLIMIT
    as cpu_policy.NATS_SERVER_GO_ENV says, each unless .env sets it (tests/integration/test_procfile_nats.py
    runs the line)."""
    start = nats_server_exec()
    for name, value in NATS_SERVER_GO_ENV.items():
        assert f'{name}="${{{name}:-{value}}}"' in start
    generated = next(x for x in procfile(1, 1, 1, 1, "t.py", "l.py").splitlines() if x.startswith("nats:"))
    committed = next(x for x in (ROOT / "Procfile").read_text().splitlines() if x.startswith("nats:"))
    assert generated.startswith(f"nats: {start} -c ") and committed.startswith(f"nats: {start} -c ")


def test_procfile_refuses_zero_replicas():
    with pytest.raises(ConfigError, match="--ps-replicas"):
        procfile(1, 0, 1, 1, "t.py", "l.py")


def test_launcher_reports_config_errors_with_exit_2(capsys, tmp_path):
    bad = tmp_path / "global.yml"
    bad.write_text("common_config:\n  jobname: x\n")
    assert main(["embedding-parameter-server", "--global-config", str(bad)]) == 2
    assert "unknown key 'common_config.jobname'" in capsys.readouterr().err
    assert main(["embedding-parameter-server", "--replica-index", "3", "--replica-size", "2"]) == 2
    assert main(["nn-worker", str(tmp_path / "missing.py")]) == 2


def test_a_failing_rank_stops_the_others():
    import subprocess
    import sys
    import time

    from persia_nats.services.nn_worker.main import wait_ranks

    ok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bad = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    start = time.monotonic()
    assert wait_ranks([ok, bad]) == 3
    assert ok.poll() is not None and time.monotonic() - start < 30


def test_compile_kernels_loads_every_roles_kernels(capsys):
    assert main(["compile-kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["PS store", "pooling and float16", "NN hot rows", "cache"]
    # each warm-up ran (functools.cache then remembers it): the kernels are in numba's cache now
    from persia_nats.core.plan import warm_up as pooling_kernels
    from persia_nats.core.store import warm_up as store_kernels
    assert store_kernels.cache_info().currsize == 1 and pooling_kernels.cache_info().currsize == 1


def _launch_nn_worker(tmp_path, body: str, *flags: str):
    import subprocess

    from tests.procs import ROOT, launcher_cmd

    script = tmp_path / "rank.py"
    script.write_text(body)
    return subprocess.Popen(launcher_cmd("nn-worker", str(script), *flags), cwd=ROOT)


def test_nn_worker_stay_alive_waits_for_sigterm_after_the_ranks_succeed(tmp_path):
    import os
    import signal
    import subprocess
    import time

    done = tmp_path / "rank.pid"
    launcher = _launch_nn_worker(tmp_path, f"import os; open({str(done)!r}, 'w').write(str(os.getpid()))\n",
                                 "--nnodes", "2", "--node-rank", "1", "--stay-alive")
    try:
        while not done.exists() or not done.read_text():
            assert launcher.poll() is None, "the launcher exited before its rank ran"
            time.sleep(0.02)
        rank_pid = int(done.read_text())
        while os.path.exists(f"/proc/{rank_pid}"):  # gone once the launcher has reaped it
            time.sleep(0.02)
        with pytest.raises(subprocess.TimeoutExpired):
            launcher.wait(1)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 0
    finally:
        launcher.kill()
        launcher.wait()


def test_nn_worker_stay_alive_does_not_hide_a_failed_rank(tmp_path):
    launcher = _launch_nn_worker(tmp_path, "import sys; sys.exit(3)\n", "--stay-alive")
    try:
        assert launcher.wait(60) == 3
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.parametrize("flags, shared", [((), ""), (("--share-gpus",), "1")])
def test_nn_worker_share_gpus_reaches_every_rank(tmp_path, flags, shared):
    import os

    body = ("import os, sys; open(sys.argv[0] + '.' + os.environ['LOCAL_RANK'], 'w')"
            ".write(os.environ.get('PERSIA_SHARE_GPUS', ''))\n")
    env_before = os.environ.pop("PERSIA_SHARE_GPUS", None)
    try:
        launcher = _launch_nn_worker(tmp_path, body, "--nproc-per-node", "2", *flags)
        assert launcher.wait(60) == 0
    finally:
        if env_before is not None:
            os.environ["PERSIA_SHARE_GPUS"] = env_before
    assert [(tmp_path / f"rank.py.{r}").read_text() for r in (0, 1)] == [shared, shared]
