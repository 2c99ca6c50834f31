"""PERSIA_CPU_POLICY: a role's threads, now and later, yield shared cores to the NN worker's."""

import os
import subprocess
import sys

import pytest
from persia_nats.common.cpu_policy import (
    NATS_SERVER_GO_ENV,
    OPENMP_WAIT_VARS,
    apply_cpu_policy,
    choice_from_env,
    nats_server_env,
    openmp_env,
)
from persia_nats.common.errors import ConfigError

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "sched_getscheduler"),
                           reason="scheduling policies are Linux's")

# starts a thread, applies the policy, starts another, and prints each thread's policy, and a child
# process's, by number
POLICIES = """
import os, subprocess, sys, threading
from persia_nats.common.cpu_policy import apply_cpu_policy
before = threading.Event(); done = threading.Event(); tids = {}
def wait(name, event):
    tids[name] = threading.get_native_id(); event.set(); done.wait()
early = threading.Thread(target=wait, args=("early", before)); early.start(); before.wait()
print(apply_cpu_policy())
after = threading.Event()
late = threading.Thread(target=wait, args=("late", after)); late.start(); after.wait()
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(os.sched_getscheduler(0), os.sched_getscheduler(tids["early"]), os.sched_getscheduler(tids["late"]), child)
done.set()
"""


def policies(value: str | None) -> tuple[str, list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "PERSIA_CPU_POLICY"}
    if value is not None:
        env["PERSIA_CPU_POLICY"] = value
    lines = subprocess.run([sys.executable, "-c", POLICIES], env=env, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return lines[0], [int(x) for x in lines[1].split()]


@linux
@pytest.mark.parametrize(("value", "policy"), [("idle", "SCHED_IDLE"), (" Batch ", "SCHED_BATCH")])
def test_every_thread_now_and_later_and_every_child_takes_the_policy(value, policy):
    applied, seen = policies(value)
    assert applied == value.strip().lower()
    assert seen == [getattr(os, policy)] * 4  # main thread, a thread from before, one from after, a child


@linux
@pytest.mark.parametrize("value", [None, "", "normal"])
def test_unset_or_normal_changes_nothing(value):
    applied, seen = policies(value)
    assert applied == "None" and seen == [os.SCHED_OTHER] * 4


@pytest.mark.parametrize("value", ["low", "SCHED_IDLE", "0", "fifo"])
def test_a_value_that_names_no_policy_is_refused_naming_the_variable(value):
    with pytest.raises(ConfigError, match=f"PERSIA_CPU_POLICY='{value}': expected one of normal, batch, idle"):
        choice_from_env({"PERSIA_CPU_POLICY": value})
    with pytest.raises(ConfigError, match="PERSIA_CPU_POLICY"):
        apply_cpu_policy({"PERSIA_CPU_POLICY": value})


def test_the_launcher_and_a_users_script_refuse_it_with_status_2(tmp_path):
    env = {**os.environ, "PERSIA_CPU_POLICY": "realtime"}
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    for cmd in (["-m", "persia.launcher", "health", "embedding-worker", "--timeout", "1"],
                ["-m", "persia.script", str(script)]):
        out = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "ran" not in out.stdout
        assert "PERSIA_CPU_POLICY='realtime': expected one of normal, batch, idle" in out.stderr


def test_the_nn_worker_is_warned_off_idle(tmp_path):
    """Allowed (the user's host, the user's choice) but said: the NN worker is the job's critical path."""
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    env = {**os.environ, "PERSIA_CPU_POLICY": "idle"}
    out = subprocess.run([sys.executable, "-m", "persia.launcher", "nn-worker", str(script)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ran" in out.stdout
    assert "PERSIA_CPU_POLICY=idle gives the NN worker" in out.stderr


def test_nn_worker_ranks_get_passive_openmp_workers_unless_told_otherwise():
    assert openmp_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_env({"OMP_WAIT_POLICY": " "}) == {"OMP_WAIT_POLICY": "PASSIVE"}  # empty: not a choice
    for name in OPENMP_WAIT_VARS:
        assert openmp_env({name: "1"}) == {}


def test_nats_server_gets_the_go_runtime_settings_unless_told_otherwise():
    assert nats_server_env({"PATH": "/bin"}) == {"PATH": "/bin", **NATS_SERVER_GO_ENV}
    blank_is_unset = {"GOGC": "150", "GOMEMLIMIT": NATS_SERVER_GO_ENV["GOMEMLIMIT"]}
    assert nats_server_env({"GOGC": "150", "GOMEMLIMIT": " "}) == blank_is_unset
    assert nats_server_env({"GOGC": "off", "GOMEMLIMIT": "8GiB"}) == {"GOGC": "off", "GOMEMLIMIT": "8GiB"}


def test_the_launcher_starts_each_rank_with_the_openmp_setting(tmp_path):
    """Set in the rank's environment, before it starts: the OpenMP runtime reads it once, at load."""
    script = tmp_path / "train.py"
    # one write per rank: the two ranks share the pipe
    script.write_text("import os\n"
                      "line = f\"wait: {os.environ.get('OMP_WAIT_POLICY')} {os.environ['RANK']}\\n\"\n"
                      "os.write(1, line.encode())\n")
    base = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
    for env, want in ((base, "PASSIVE"), ({**base, "OMP_WAIT_POLICY": "active"}, "active")):
        out = subprocess.run([sys.executable, "-m", "persia.launcher", "nn-worker", str(script), "--nproc-per-node",
                              "2"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert sorted(out.stdout.split("\n"))[1:] == [f"wait: {want} 0", f"wait: {want} 1"]
