"""End-to-end throughput: the full multi-process pipeline against a single-process PyTorch reference.

    .venv/bin/python benchmarks/bench_e2e.py [--batch-sizes 1024,4096] [--repeats 3] [--json]

Pipeline: nats-server, PS replicas, an embedding worker, an NN worker and a data loader as separate processes
(persia-launcher), hybrid mode, staleness 4, the PS's table started at the rows a run fills (``initial_rows``
in e2e/global_config.yml; ``--initial-rows``), whose memory the PS commits as the table is made, as the
reference's table is allocated and filled before it times a batch. The PS, embedding worker and loader share
the cores with the NN worker as the Procfile runs them, yielding to it (``PERSIA_CPU_POLICY=idle``;
``--sparse-cpu-policy normal`` gives them the kernel's default). Reference: one process, one
``EmbeddingBag(sparse=True)`` holding all 26 slots, the same MLP (429-512-256-128-1), Adagrad on the
embeddings, Adam on the dense part, the same pre-generated synthetic Criteo-like batches (26 slots, dim 16,
Zipf ids over 1e6 per slot, 13 dense features), run with 1 and 2 torch threads, the faster counting, its table
on 2 MiB pages as the PS keeps its own (``--reference-small-pages``: torch's default 4 KiB pages). The NN
worker is run the same way, with 1 and 2 torch threads, the faster counting: the dense model is the largest
CPU cost of both sides, and on a 2-core machine whether a second thread helps depends on how busy the sparse
roles keep the other core. Both time the batches after a warm-up. Prints one table (medians over repeats,
ratio = pipeline / reference from the same run), the share of the timed stretch the NN worker's training loop
waited for a looked-up batch ("nn waits": cores the pipeline left idle), the peak RSS of every process, and
where the CPU goes: user + system microseconds per trained sample of every role (its whole process tree,
nats-server included) while the NN worker timed its batches, beside the reference's own, and the kernel's
share of each (system time: system calls, and the page faults that commit a growing table's memory, whose
price depends on the host: ``bench_first_touch.py``). The NN worker's CPU is split by thread, and of its
training thread's, the runtime's own work (``train_host_cpu_us``: taking each batch, making it tensors,
handing off its gradients, which the I/O thread packs) is told apart from the model's: with the I/O thread,
that is the NN worker's host work outside the dense model. With --json, one JSON line last.

On a machine with a GPU the NN worker trains on it (``--nn-device cpu`` keeps it off), in float32
like the reference, and ``--reference-devices cpu,cuda,cuda-all`` times the reference three ways:
all on the CPU; the MLP on the GPU with the table and its Adagrad on the CPU, as the pipeline keeps
them; everything on the GPU, which only a table that fits in one GPU allows. The CPU table's
reference column is the first of those.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import Job, job_env, write_global_config  # noqa: E402

HERE = ROOT / "benchmarks" / "e2e"
sys.path.insert(0, str(HERE))

from cpu import CpuSampler  # noqa: E402


def vm_hwm_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON result in:\n{text[-3000:]}")


def json_objects(text: str, role: str) -> list[dict]:
    """Every ``{"role": role, ...}`` object in ``text``: ranks share one log, so two lines can run together."""
    decoder, out, start = json.JSONDecoder(), [], 0
    marker = json.dumps({"role": role})[:-1]
    while (i := text.find(marker, start)) >= 0:
        obj, end = decoder.raw_decode(text, i)
        out.append(obj)
        start = end
    return out


def run_pipeline(url: str, batch_size: int, batches: int, ps_replicas: int, workers: int = 1, nproc: int = 1,
                 nats_pid: int | None = None, nn_threads: int = 1, nn_device: str = "auto",
                 sparse_cpu_policy: str = "normal", share_gpus: bool = False, embedding_gather: str = "auto",
                 initial_rows: int | None = None) -> dict:
    bench_env = {"BENCH_BATCH_SIZE": str(batch_size), "BENCH_BATCHES": str(batches),
                 # more NN ranks than GPUs share them (gloo) instead of training on the CPU
                 "PERSIA_SHARE_GPUS": "1" if share_gpus else "0",
                 "BENCH_NN_THREADS": str(nn_threads),
                 # "cpu" hides the GPUs; "auto" lets the NN worker take one when there is one
                 **({"CUDA_VISIBLE_DEVICES": ""} if nn_device == "cpu" else {}),
                 "PERSIA_EMBEDDING_CONFIG": str(ROOT / "examples" / "synthetic" / "config" / "embedding_config.yml"),
                 "LOG_LEVEL": "warning"}
    with tempfile.TemporaryDirectory() as tmp:
        # the bench's config with this run's settings (``auto`` is the config's own default)
        bench_env["PERSIA_GLOBAL_CONFIG"] = str(write_global_config(
            Path(tmp) / "global_config.yml", base=HERE / "global_config.yml", embedding_gather=embedding_gather,
            embedding_parameter_server_config={} if initial_rows is None else {"initial_rows": initial_rows}))
        job = Job(job_env(url, f"b{uuid.uuid4().hex[:10]}", **bench_env), Path(tmp))
        try:
            job.start_roles(HERE / "nn.py", HERE / "loader.py", ps=ps_replicas, workers=workers, nproc=nproc,
                            sparse_env={"PERSIA_CPU_POLICY": sparse_cpu_policy})
            roots = {name: p.pid for name, p in job.procs.items()} | ({"nats": nats_pid} if nats_pid else {})
            with CpuSampler(roots, threads_of=("nn",)) as cpu:
                if job.wait("nn", timeout=900) != 0 or job.wait("loader", timeout=60) != 0:
                    raise RuntimeError(f"pipeline run failed:\n{job.dump_logs()}")
            rss = {name: vm_hwm_mb(p.pid) for name, p in job.procs.items() if name.startswith(("ps", "ew"))}
            ranks = json_objects(job.log("nn"), role="nn")
            loader = last_json(job.log("loader"))
        finally:
            job.stop_all()
    if len(ranks) != nproc:
        raise RuntimeError(f"expected {nproc} NN results, got {len(ranks)}")
    rss.update(nn=max(r["peak_rss_mb"] for r in ranks), loader=loader["peak_rss_mb"])
    # ranks step together, so the job's rate is the sum of the ranks' rates, and the timed stretch
    # runs from the first rank's start to the last rank's end
    start, end = min(r["timed_from"] for r in ranks), max(r["timed_to"] for r in ranks)
    samples = sum(r["timed_samples"] for r in ranks)
    spent = {k: s / samples * 1e6 for k, s in cpu.between(start, end).items()}
    cpu_us = {k: v for k, v in spent.items() if "/" not in k and ":" not in k}
    sys_us = {k.removesuffix(":sys"): v for k, v in spent.items() if k.endswith(":sys")}
    nn_threads_us = {k.split("/", 1)[1]: v for k, v in spent.items() if k.startswith("nn/")}
    # of the training threads' CPU, what the runtime's own work took (batches to tensors, gradients handed
    # off): with the I/O thread, which packs them, the NN worker's host work outside the model
    nn_threads_us["main: runtime's own"] = sum(r.get("train_host_cpu_s", 0.0) for r in ranks) / samples * 1e6
    # the share of the timed stretch the training loop spent waiting for a looked-up batch
    waits = statistics.mean(r["train_wait_s"] / (r["timed_to"] - r["timed_from"]) for r in ranks)
    # the sampler's own CPU, as a share of one core: taken from the pipeline's cores, not the reference's
    sampled = cpu.times[-1] - cpu.times[0] if len(cpu.times) > 1 else 0.0
    sampler_share = cpu.own_cpu_s / sampled if sampled > 0 else 0.0
    return {"samples_per_s": sum(r["samples_per_s"] for r in ranks), "rss": rss, "cpu_us_per_sample": cpu_us,
            "sys_us_per_sample": sys_us,
            "nn_threads": nn_threads, "nn_wait_share": waits, "nn_device": ranks[0]["device"],
            "nn_by_thread_us_per_sample": nn_threads_us, "sampler_core_share": sampler_share}


def run_reference(batch_size: int, batches: int, threads: int, device: str = "cpu", huge_pages: bool = True) -> dict:
    env = dict(os.environ, BENCH_BATCH_SIZE=str(batch_size), BENCH_BATCHES=str(batches))
    if huge_pages:
        # torch's CPU allocator advises 2 MiB pages for its blocks of 2 MiB and more (the table, its
        # Adagrad state): the choice the PS makes for its own tables. On 4 KiB pages the reference's
        # random reads of its 3.3 GB ran 46-61k samples/s from run to run at batch 4096, against 60-63k.
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    else:
        env.pop("THP_MEM_ALLOC_ENABLE", None)
    out = subprocess.run([sys.executable, str(HERE / "reference.py"), str(threads), device], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"reference failed:\n{out.stderr[-3000:]}")
    return last_json(out.stdout)


def median_by_key(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for r in runs for k in r)  # a kind of thread may be missing from a run
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def print_cpu_table(rows: list[dict]) -> None:
    """CPU microseconds per sample by role (medians over repeats); 'pipeline' is the sum of the roles; below
    each batch size, the kernel's share of them (system time: system calls and page faults)."""
    roles = [k for k in rows[0]["cpu_us_per_sample"] if k != "reference"]
    print(f"\nCPU us per sample (user + system){'':>4}" + "".join(f"{k:>9}" for k in roles)
          + f"{'pipeline':>10}{'reference':>10}{'x ref':>7}")
    for r in rows:
        c, k_us = r["cpu_us_per_sample"], r["sys_us_per_sample"]
        total = sum(c[k] for k in roles)
        print(f"batch {r['batch_size']:<30}" + "".join(f"{c[k]:>9.1f}" for k in roles)
              + f"{total:>10.1f}{c['reference']:>10.1f}{total / c['reference']:>7.2f}")
        print(f"{'  of which system':<36}" + "".join(f"{k_us.get(k, 0.0):>9.1f}" for k in roles)
              + f"{sum(k_us.get(k, 0.0) for k in roles):>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=400_000, help="timed samples per run")
    parser.add_argument("--ps-replicas", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="embedding workers")
    parser.add_argument("--reference-threads", type=lambda x: [int(t) for t in x.split(",")], default=[1, 2],
                        help="torch thread counts tried for the reference; the fastest counts")
    parser.add_argument("--nn-threads", type=lambda x: [int(t) for t in x.split(",")], default=[1, 2],
                        help="torch thread counts tried for the NN worker; the fastest counts")
    parser.add_argument("--reference-devices", type=lambda x: x.split(","), default=["cpu"],
                        help="where the reference trains: cpu; cuda (the MLP on the GPU, the table on the CPU); "
                             "cuda-all (the table on the GPU too). Ratios are against each; the first is the "
                             "ratio of the JSON line")
    parser.add_argument("--nn-device", choices=("auto", "cpu"), default="auto",
                        help="auto: the NN worker trains on a GPU where there is one; cpu: it never does")
    parser.add_argument("--sparse-cpu-policy", choices=("normal", "batch", "idle"), default="idle",
                        help="PERSIA_CPU_POLICY of the PS, embedding workers and loader, which share the cores "
                             "with the NN worker (idle: they yield them to it, as the Procfile runs them)")
    parser.add_argument("--reference-small-pages", action="store_true",
                        help="leave the reference's table on 4 KiB pages (torch's default) instead of 2 MiB ones")
    parser.add_argument("--embedding-gather", choices=("auto", "host", "device"), default="auto",
                        help="nn_worker_config.embedding_gather: where a gathered width's slots are built (auto: "
                             "on the device when the NN worker has a GPU, on its I/O thread otherwise)")
    parser.add_argument("--initial-rows", type=int, default=None,
                        help="embedding_parameter_server_config.initial_rows (default: e2e/global_config.yml's, "
                             "the rows a 200k-sample run fills; 1024, the shipped default, doubles the index during "
                             "the run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    devices = args.reference_devices
    server = start_nats_server()
    rows = []
    try:
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            batches = max(10, args.samples // bs)
            pipe, rss, cpu, system, nn_threads, waits, by_thread, sampler = [], {}, [], [], [], [], [], []
            refs: dict[str, list[float]] = {d: [] for d in devices}
            for _ in range(args.repeats):
                r = max((run_pipeline(server.url, bs, batches, args.ps_replicas, args.workers, nats_pid=server.proc.pid,
                                      nn_threads=t, nn_device=args.nn_device, sparse_cpu_policy=args.sparse_cpu_policy,
                                      embedding_gather=args.embedding_gather, initial_rows=args.initial_rows)
                         for t in args.nn_threads),
                        key=lambda x: x["samples_per_s"])
                pipe.append(r["samples_per_s"])
                nn_threads.append(r["nn_threads"])
                waits.append(r["nn_wait_share"])
                rss = {k: max(v, rss.get(k, 0.0)) for k, v in r["rss"].items()}
                ref_cpu = {}
                for d in devices:
                    # the stronger of 1 and 2 threads: on 2 busy cores, 2 torch threads can collapse
                    f = max((run_reference(bs, batches, t, d, not args.reference_small_pages)
                             for t in args.reference_threads),
                            key=lambda x: x["samples_per_s"])
                    refs[d].append(f["samples_per_s"])
                    rss[f"reference {d}"] = max(f["peak_rss_mb"], rss.get(f"reference {d}", 0.0))
                    ref_cpu.setdefault("reference", f["cpu_us_per_sample"])
                cpu.append(r["cpu_us_per_sample"] | ref_cpu)
                system.append(r["sys_us_per_sample"])
                by_thread.append(r["nn_by_thread_us_per_sample"])
                sampler.append(r["sampler_core_share"])
                # each run as it ends, so that a run cut short still leaves its figures
                print(f"run: batch {bs} pipeline {pipe[-1]:.0f}/s on {r['nn_device']}, "
                      + ", ".join(f"reference {d} {refs[d][-1]:.0f}/s" for d in devices), flush=True)
            ratios = {d: statistics.median(p / q for p, q in zip(pipe, refs[d], strict=True)) for d in devices}
            rows.append({"batch_size": bs, "pipeline_samples_per_s": statistics.median(pipe),
                         "reference_samples_per_s": statistics.median(refs[devices[0]]),
                         "ratio": ratios[devices[0]], "nn_device": r["nn_device"],
                         "by_reference_device": {d: {"samples_per_s": statistics.median(refs[d]), "ratio": ratios[d]}
                                                 for d in devices},
                         "peak_rss_mb": rss, "cpu_us_per_sample": median_by_key(cpu),
                         "sys_us_per_sample": median_by_key(system),
                         "nn_by_thread_us_per_sample": median_by_key(by_thread),
                         "nn_wait_share": statistics.median(waits),
                         "sampler_core_share": max(sampler),
                         "runs": {"pipeline": pipe, "reference": refs, "nn_threads": nn_threads,
                                  "nn_wait_share": waits}})
    finally:
        server.stop()
    refs_head = "".join(f" {'ref ' + d + '/s':>14} {'ratio':>6}" for d in devices)
    print(f"{'batch':>6} {'NN on':>7} {'pipeline/s':>12}{refs_head} {'nn threads':>11} {'nn waits':>9}   peak RSS MB")
    for r in rows:
        rss = " ".join(f"{k}={v:.0f}" for k, v in r["peak_rss_mb"].items())
        threads = ",".join(str(t) for t in r["runs"]["nn_threads"])
        by = "".join(f" {x['samples_per_s']:>14.0f} {x['ratio']:>6.2f}"
                     for x in (r["by_reference_device"][d] for d in devices))
        print(f"{r['batch_size']:>6} {r['nn_device']:>7} {r['pipeline_samples_per_s']:>12.0f}{by} {threads:>11} "
              f"{r['nn_wait_share']:>9.0%}   {rss}")
    print(f"PS, embedding workers and loader ran with PERSIA_CPU_POLICY={args.sparse_cpu_policy}; "
          f"the NN worker with embedding_gather={args.embedding_gather}; sampling the CPU took at most "
          f"{max(r['sampler_core_share'] for r in rows):.1%} of a core")
    print_cpu_table(rows)
    print("\nNN worker by thread, us per sample (main: the training loop; main: runtime's own: of that, the "
          "runtime's work outside the model and the dense step; persia-nn-<rank>: its I/O thread; unnamed: torch's "
          "OpenMP workers)")
    for r in rows:
        kinds = sorted(r["nn_by_thread_us_per_sample"].items(), key=lambda x: -x[1])
        print(f"batch {r['batch_size']:<6}" + "  ".join(f"{k} {v:.1f}" for k, v in kinds))
    if args.json:
        last = rows[-1]
        print(json.dumps({"ratio": last["ratio"], "sparse_cpu_policy": args.sparse_cpu_policy,
                          "embedding_gather": args.embedding_gather,
                          "pipeline_samples_per_s": last["pipeline_samples_per_s"],
                          "reference_samples_per_s": last["reference_samples_per_s"],
                          "peak_rss_mb": last["peak_rss_mb"], "cpu_us_per_sample": last["cpu_us_per_sample"],
                          "rows": rows}))


if __name__ == "__main__":
    main()
