"""PERSIA's Procfile line ``data_loader: python3 data_loader.py && cat`` under real honcho 2.

honcho starts each process from a ``multiprocessing.Process``, which gives it ``/dev/null`` as stdin:
``cat`` exits at once, and honcho stops the whole job, rc 0, as soon as any process stops. The data
loader here stands for one whose ``DataCtx`` delivered every batch (``persia.stay``); the NN worker is
a shell line that "evaluates" for a few seconds, then prints its result and exits with a given status.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run_honcho(tmp_path: Path, loader: str, nn_code: int) -> tuple[int, str]:
    (tmp_path / "data_loader.py").write_text(loader)
    (tmp_path / "Procfile").write_text(
        "data_loader: python3 data_loader.py && cat \n"
        f"nn_worker: sleep 3; echo 'rank 0 test_auc=0.89'; exit {nn_code}\n")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(BIN / "honcho"), "start"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


DONE = "from persia.stay import stay_if_cat_follows\nprint('sent every batch', flush=True)\nstay_if_cat_follows()\n"


def test_without_staying_cat_ends_the_job_before_the_nn_worker_reports(tmp_path: Path) -> None:
    code, out = run_honcho(tmp_path, "print('sent every batch', flush=True)\n", nn_code=3)
    assert "data_loader.1 stopped (rc=0)" in out, out
    assert "test_auc" not in out and code == 0, out  # the failure PERSIA users met: cut off, and rc 0


@pytest.mark.parametrize("nn_code", [0, 3])
def test_the_job_ends_with_the_nn_workers_result_and_status(tmp_path: Path, nn_code: int) -> None:
    code, out = run_honcho(tmp_path, DONE, nn_code)
    assert code == nn_code, out
    assert "rank 0 test_auc=0.89" in out, out
    assert out.index(f"nn_worker.1 stopped (rc={nn_code})") < out.index("data_loader.1 stopped"), out
    assert "staying until the job stops it" in out, out


def test_a_data_loader_that_failed_still_stops_the_job(tmp_path: Path) -> None:
    code, out = run_honcho(tmp_path, DONE + "raise RuntimeError('bad row')\n", nn_code=0)
    assert "data_loader.1 stopped (rc=1)" in out and code == 1, out
    assert "test_auc" not in out, out
