"""The allocator settings every role starts with: buffers of a batch's size reuse the heap's pages."""

import os
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                           reason="mallopt's settings are glibc's")

# two 2 MiB buffers made and dropped together, as a role makes a payload and its copy per message: by
# default glibc hands the 4 MiB freed at the top of its heap back to the kernel, and takes a page fault
# for every 4 KiB when they are made again
ROUNDS = """
import resource, sys
from persia_nats.common.malloc import tune_malloc
print(tune_malloc())
for _ in range(3):
    a = bytearray(2 << 20); b = bytearray(2 << 20); del a, b
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    a = bytearray(2 << 20); b = bytearray(2 << 20); del a, b
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
"""


def rounds(**env: str) -> tuple[str, float]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PERSIA_MALLOC", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", ROUNDS], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], float(out[1])


@glibc
def test_tuned_buffers_of_a_batch_size_fault_no_pages_in():
    took, faults = rounds()
    assert took == "True" and faults < 16  # 1024 pages a round were made afresh untuned


@glibc
@pytest.mark.parametrize("env", [{"PERSIA_MALLOC": "default"}, {"PERSIA_MALLOC": " Default "},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}])
def test_the_users_choice_leaves_glibc_as_it_is(env):
    took, faults = rounds(**env)
    assert took == "False" and faults > 500


@pytest.mark.parametrize("value", ["off", "glibc", "0"])
def test_a_value_that_is_neither_choice_is_refused_naming_the_variable(monkeypatch, value):
    from persia_nats.common.errors import ConfigError
    from persia_nats.common.malloc import tune_malloc

    monkeypatch.setenv("PERSIA_MALLOC", value)
    with pytest.raises(ConfigError, match=f"PERSIA_MALLOC='{value}': expected 'tuned' or 'default'"):
        tune_malloc()


def test_the_launcher_refuses_it_with_status_2(tmp_path):
    env = {**os.environ, "PERSIA_MALLOC": "off"}
    cmd = [sys.executable, "-m", "persia.launcher", "health", "embedding-worker", "--timeout", "1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "PERSIA_MALLOC='off'" in out.stderr
