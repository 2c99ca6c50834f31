"""Serving: train the adult example with checkpoints, serve the final one over NATS, match the offline AUC.

The job trains for real (2 PS replicas, an embedding worker, the NN worker, the data loader) with a
checkpoint every 100 steps and a final one (``FINAL_CHECKPOINT=1``). The offline evaluation reads
that checkpoint in this process through the service's own pure path
(:func:`persia_nats.services.serving.snapshot.predict`, no NATS); the served one goes through
``persia-launcher serve`` with a client that uses nothing but nats-py, msgpack and numpy.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import msgpack
import nats
import numpy as np
import pytest
import torch
import yaml
from persia_nats.common.checkpoint import (
    MANIFEST,
    file_digest,
    finalize,
    latest_valid,
    list_checkpoints,
    next_number,
    partial_dir,
    read_manifest,
    write_bytes_atomic,
)
from persia_nats.common.config import load_embedding_config
from persia_nats.common.discovery import discover
from persia_nats.common.messages import IdFeature
from persia_nats.services.serving.model import model_factory
from persia_nats.services.serving.snapshot import load_snapshot, predict

from tests.procs import ADULT, Job, job_env

MODEL = "examples/adult-income/model.py:DNN"
MODEL_KWARGS = {"dense_dim": 5}
RELOAD_INTERVAL = 0.5
BATCH = 1024


def _load(name: str, path: Path):  # noqa: ANN202
    if str(ADULT) not in sys.path:
        sys.path.insert(0, str(ADULT))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


adult_data = _load("adult_data", ADULT / "adult_data.py")
adult_metrics = _load("adult_metrics", ADULT / "metrics.py")
ECFG = load_embedding_config(ADULT / "config" / "embedding_config.yml")


# -- a plain client: nats-py, msgpack, numpy ---------------------------------------------------------


def arr(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def batch_map(ids: np.ndarray, dense: np.ndarray) -> dict:
    n = ids.shape[0]
    return {"v": 1,
            "features": [{"name": name, "values": arr(np.ascontiguousarray(ids[:, j], dtype=np.uint64)),
                          "lengths": arr(np.ones(n, np.int32))} for j, name in enumerate(adult_data.CATEGORICAL)],
            "non_id": [{"name": "continuous", "data": arr(dense.astype(np.float32))}]}


async def call(nc, subject: str, body: dict | bytes, timeout: float = 30.0) -> tuple[int, dict | str]:
    """(200, reply map) or (error code, error text)."""
    payload = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    msg = await nc.request(subject, payload, timeout=timeout)
    headers = msg.headers or {}
    if "Nats-Service-Error-Code" in headers:
        return int(headers["Nats-Service-Error-Code"]), headers.get("Nats-Service-Error", "")
    return 200, msgpack.unpackb(msg.data, raw=False)


def predictions(reply: dict) -> np.ndarray:
    p = reply["predictions"]
    assert p["dtype"] == "<f4", p["dtype"]
    return np.frombuffer(p["data"], np.float32).reshape(p["shape"])


# -- offline: the same pure path, no NATS ------------------------------------------------------------


def features_of(ids: np.ndarray) -> list[IdFeature]:
    n = ids.shape[0]
    return [IdFeature(name, np.ascontiguousarray(ids[:, j], dtype=np.uint64), np.ones(n, np.int32))
            for j, name in enumerate(adult_data.CATEGORICAL)]


def offline(snap, split) -> np.ndarray:
    return np.concatenate([predict(snap, ECFG, features_of(ids), [dense])
                           for ids, dense, _ in adult_data.batches(split, BATCH)])


def derive_checkpoint(src: Path, root: Path, bias_shift: float, corrupt: bool = False) -> Path:
    """A newer checkpoint: ``src`` with the output bias shifted, sealed with a fresh manifest.

    ``corrupt`` flips a byte of an embedding file after it was hashed and before the checkpoint is
    sealed, so it is never seen intact (as after bit rot, or a copy gone wrong).
    """
    partial = partial_dir(root, next_number(root))
    shutil.copytree(src, partial, ignore=shutil.ignore_patterns(MANIFEST))
    state = torch.load(partial / "dense" / "model.pt", weights_only=True)
    state["ln3.bias"] = state["ln3.bias"] + bias_shift
    buf = io.BytesIO()
    torch.save(state, buf)
    write_bytes_atomic(partial / "dense" / "model.pt", buf.getvalue())
    manifest = read_manifest(src)
    files = {rel: file_digest(partial / rel) for rel in manifest["files"]}
    if corrupt:
        shard = sorted((partial / "ps").rglob("dim8.emb.npy"))[0]
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF
        shard.write_bytes(bytes(raw))
    return finalize(partial, files, extra={"step": manifest["step"], "ps_replicas": manifest["ps_replicas"]})


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(nats_server, tmp_path_factory):
    """The adult job trained with checkpoints every 100 steps and a final one."""
    tmp = tmp_path_factory.mktemp("serving")
    cfg = yaml.safe_load((ADULT / "config" / "global_config.yml").read_text())
    cfg["common_config"]["checkpointing_config"] = {"every_batches": 100, "keep": 5}
    (tmp / "global.yml").write_text(yaml.safe_dump(cfg))
    root = tmp / "ckpt"
    env = job_env(nats_server.url, f"t{uuid.uuid4().hex[:12]}", PERSIA_GLOBAL_CONFIG=str(tmp / "global.yml"),
                  PERSIA_CHECKPOINT_DIR=str(root), FINAL_CHECKPOINT="1")
    job = Job(env, tmp)
    try:
        job.start_roles(ADULT / "train.py", ADULT / "data_loader.py", ps=2, workers=1)
        assert job.wait("nn", timeout=300) == 0, job.dump_logs()
        result = job.json_result("nn")
    finally:
        job.stop_all()
    return SimpleNamespace(root=root, env=env, job=env["PERSIA_JOB_NAME"], result=result, tmp=tmp,
                           test=adult_data.load_split("test"))


@pytest.fixture(scope="module")
def server(trained):
    """``persia-launcher serve`` on the trained job's checkpoint root."""
    job = Job(trained.env, trained.tmp)
    job.start("serve", "serve", "--model", MODEL, "--model-kwargs", json.dumps(MODEL_KWARGS),
              "--reload-interval", str(RELOAD_INTERVAL))
    prefix = f"persia.{trained.job}.serve"
    server = SimpleNamespace(job=job, predict=f"{prefix}.predict", info=f"{prefix}.info",
                             url=trained.env["PERSIA_NATS_URL"])

    async def ready() -> dict:
        nc = await nats.connect(server.url)
        try:
            for _ in range(600):
                try:
                    code, info = await call(nc, server.info, {"v": 1}, timeout=2)
                    if code == 200 and info["checkpoint"]:
                        return info
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    pass
                await asyncio.sleep(0.1)
        finally:
            await nc.close()
        raise AssertionError(f"the server never loaded a checkpoint:\n{job.dump_logs()}")

    try:
        server.first_info = asyncio.run(ready())
        yield server
    finally:
        codes = job.stop_all()
        assert codes["serve"] == 0, (codes, job.log("serve")[-3000:])


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_served_predictions_match_the_offline_evaluation_of_the_checkpoint(trained, server):
    steps = trained.result["steps"]
    ckpts = list_checkpoints(trained.root)
    assert len(ckpts) >= 3, ckpts  # steps 100, 200 and the final one
    final = latest_valid(trained.root)
    assert final == ckpts[0] and read_manifest(final)["step"] == steps == 255, (final, trained.result)
    assert server.first_info["checkpoint"] == final.name

    # offline: the checkpoint's files in this process, the service's pure path, no NATS
    snap = load_snapshot(final, model_factory(MODEL, MODEL_KWARGS))
    labels = trained.test.labels.ravel()
    offline_p = offline(snap, trained.test)
    offline_auc = adult_metrics.auc(labels, offline_p)
    # the job's own eval_ctx (embedding workers and PSs over NATS) saw the same inputs
    assert abs(offline_auc - trained.result["test_auc"]) < 1e-6, (offline_auc, trained.result)
    assert offline_auc >= 0.89

    async def serve_all() -> tuple[list[np.ndarray], list[str]]:
        nc = await nats.connect(server.url)
        try:
            replies = await asyncio.gather(*(call(nc, server.predict, batch_map(ids, dense))
                                             for ids, dense, _ in adult_data.batches(trained.test, BATCH)))
            # srv discovery lists the server like every other role
            found = await discover(nc, trained.job, "serving", timeout=1.0)
        finally:
            await nc.close()
        assert all(code == 200 for code, _ in replies), replies[:3]
        assert len(found) == 1 and found[0]["instance"] == server.first_info["instance"], found
        return [predictions(r) for _, r in replies], [r["checkpoint"] for _, r in replies]

    served, names = asyncio.run(serve_all())
    served_p = np.concatenate(served)
    assert set(names) == {final.name}
    assert served_p.shape == (16281, 1)
    np.testing.assert_allclose(served_p, offline_p, rtol=0, atol=1e-6)
    served_auc = adult_metrics.auc(labels, served_p)
    assert abs(served_auc - offline_auc) < 1e-6, (served_auc, offline_auc)


@pytest.mark.slow
def test_the_example_client_gets_the_jobs_own_test_auc(trained, server):
    """examples/clients/predict_adult.py (nats-py, msgpack and numpy) against the server: every row of
    adult.test, and the AUC the job's own evaluation reported."""
    out = subprocess.run([sys.executable, str(ADULT.parent / "clients" / "predict_adult.py"), "--nats-url", server.url,
                          "--job", trained.job], capture_output=True, text=True, timeout=300, env=trained.env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["samples"] == 16281 and result["checkpoint"] == [server.first_info["checkpoint"]], result
    assert abs(result["test_auc"] - trained.result["test_auc"]) < 1e-6, (result, trained.result)


@pytest.mark.slow
def test_bad_requests_are_refused_and_unknown_ids_read_as_zeros(trained, server):
    snap = load_snapshot(latest_valid(trained.root), model_factory(MODEL, MODEL_KWARGS))
    ids, dense, _ = next(adult_data.batches(trained.test, 8))
    good = batch_map(ids, dense)

    async def run() -> dict:
        nc = await nats.connect(server.url)
        try:
            code, before = await call(nc, server.info, {"v": 1})
            assert code == 200
            bad_slot = batch_map(ids, dense)
            bad_slot["features"][0]["name"] = "no_such_slot"
            wrong_width = batch_map(ids, dense[:, :3])
            short_dense = batch_map(ids, dense[:5])
            missing_slot = batch_map(ids, dense)
            del missing_slot["features"][-1]
            cases = {
                "unknown slot": (bad_slot, "unknown slot 'no_such_slot'"),
                "dense of the wrong width": (wrong_width, "but the job's schema has <f4 [5]"),
                "a slot missing": (missing_slot, "the model refused the batch"),
                "dense of another batch size": (short_dense, "batch dimension 5 != batch_size 8"),
                "no version": ({k: v for k, v in good.items() if k != "v"}, "unsupported message version"),
                "no features": ({"v": 1, "non_id": good["non_id"]}, "features"),
                "not msgpack": (b"\xc1\xc1", "malformed msgpack"),
                "version true": ({**good, "v": True}, "unsupported message version"),
                "version 1.0": ({**good, "v": 1.0}, "unsupported message version"),
                "an empty dense array of an overflowing shape": (
                    {**good, "non_id": [{"name": "d", "data": {"dtype": "<f4", "shape": [0, 2**62], "data": b""}}]},
                    "more than a message can hold"),
                "finite dense values that overflow the model": (batch_map(ids, np.full_like(dense, 3e38)),
                                                                "output is not finite"),
            }
            for what, (body, expected) in cases.items():
                code, text = await call(nc, server.predict, body)
                assert code == 400 and expected in text, (what, code, text)
            # ids no training batch ever had: read as zeros, and nothing is inserted
            unseen = ids.astype(np.uint64) + np.uint64(10**15)
            code, reply = await call(nc, server.predict, batch_map(unseen, dense))
            assert code == 200, reply
            code, after = await call(nc, server.info, {"v": 1})
            code_good, good_reply = await call(nc, server.predict, good)
        finally:
            await nc.close()
        assert code == 200 and code_good == 200
        return {"before": before, "after": after, "unseen": predictions(reply), "good": predictions(good_reply)}

    out = asyncio.run(run())
    assert out["after"]["rows"] == out["before"]["rows"] == snap.rows
    assert out["after"]["rows_per_dim"] == out["before"]["rows_per_dim"]
    assert out["after"]["refused"] >= out["before"]["refused"] + 11
    with torch.inference_mode():
        zeros = snap.model([torch.from_numpy(dense.astype(np.float32))], [torch.zeros(8, 8)] * 8).numpy()
    np.testing.assert_allclose(out["unseen"], zeros, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["good"], predict(snap, ECFG, features_of(ids), [dense]), rtol=0, atol=1e-6)
    assert not np.allclose(out["unseen"], out["good"])


@pytest.mark.slow
def test_newer_checkpoints_are_served_without_a_torn_request_and_corrupt_ones_are_skipped(trained, server):
    root = trained.root
    current = latest_valid(root)
    factory = model_factory(MODEL, MODEL_KWARGS)
    ids, dense, _ = next(adult_data.batches(trained.test, 64))
    body = msgpack.packb(batch_map(ids, dense), use_bin_type=True)
    feats = features_of(ids)
    expected = {current.name: predict(load_snapshot(current, factory), ECFG, feats, [dense])}

    async def hammer_until(name: str, deadline: float) -> tuple[list[tuple[str, np.ndarray]], float, dict]:
        """Predict in a loop until a reply comes from checkpoint ``name``; every reply is kept."""
        nc = await nats.connect(server.url)
        seen = []
        start = time.monotonic()
        try:
            while time.monotonic() - start < deadline:
                code, reply = await call(nc, server.predict, body)
                assert code == 200, reply
                seen.append((reply["checkpoint"], predictions(reply)))
                if reply["checkpoint"] == name:
                    break
            took = time.monotonic() - start
            _, info = await call(nc, server.info, {"v": 1})
        finally:
            await nc.close()
        return seen, took, info

    def check(seen: list[tuple[str, np.ndarray]]) -> None:
        # a reply is exactly what its checkpoint gives offline: never half of one and half of another
        for name, p in seen:
            np.testing.assert_allclose(p, expected[name], rtol=0, atol=1e-6, err_msg=name)

    # a newer checkpoint with another output bias: served within the reload interval (plus its load)
    newer = derive_checkpoint(current, root, bias_shift=0.5)
    expected[newer.name] = predict(load_snapshot(newer, factory), ECFG, feats, [dense])
    assert not np.allclose(expected[newer.name], expected[current.name])
    seen, took, info = asyncio.run(hammer_until(newer.name, 30))
    assert seen[-1][0] == newer.name, (took, info)
    assert took < RELOAD_INTERVAL + 5, took
    check(seen)
    assert info["checkpoint"] == newer.name and info["reloads"] >= 1, info

    # a corrupt newer one: rejected and logged, the served one stays
    corrupt = derive_checkpoint(newer, root, bias_shift=-1.0, corrupt=True)
    seen, took, info = asyncio.run(hammer_until("never", 4 * RELOAD_INTERVAL + 1))
    assert {name for name, _ in seen} == {newer.name}, {name for name, _ in seen}
    check(seen)
    assert corrupt.name in info["rejected"] and "sha256" in info["rejected"][corrupt.name], info
    assert info["reload_failures"] >= 1 and info["checkpoint"] == newer.name, info

    # and a valid one after it is taken, the corrupt one still skipped
    newest = derive_checkpoint(newer, root, bias_shift=0.25)
    expected[newest.name] = predict(load_snapshot(newest, factory), ECFG, feats, [dense])
    seen, took, info = asyncio.run(hammer_until(newest.name, 30))
    assert seen[-1][0] == newest.name, (took, info)
    check(seen)
    assert info["reload_failures"] == 1, info  # the corrupt one was hashed once, not at every poll
    assert "rejected" in server.job.log("serve") and corrupt.name in server.job.log("serve")


@pytest.mark.slow
def test_a_server_started_before_any_checkpoint_answers_503_until_one_appears(trained, tmp_path):
    root = tmp_path / "empty-root"
    root.mkdir()
    job_name = f"t{uuid.uuid4().hex[:12]}"  # not the module's server: it would answer in the same queue group
    job = Job({**trained.env, "PERSIA_CHECKPOINT_DIR": str(root), "PERSIA_JOB_NAME": job_name}, tmp_path)
    job.start("serve", "serve", "--model", MODEL, "--model-kwargs", json.dumps(MODEL_KWARGS),
              "--reload-interval", str(RELOAD_INTERVAL))
    prefix = f"persia.{job_name}.serve"
    ids, dense, _ = next(adult_data.batches(trained.test, 4))

    async def run() -> tuple[str, dict]:
        nc = await nats.connect(trained.env["PERSIA_NATS_URL"])
        try:
            for _ in range(600):  # until the server is up
                try:
                    code, text = await call(nc, f"{prefix}.predict", batch_map(ids, dense), timeout=2)
                    break
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    await asyncio.sleep(0.1)
            assert code == 503 and "no checkpoint loaded yet" in text, (code, text)
            # a checkpoint appears in the root (copied aside, then renamed into place)
            final = latest_valid(trained.root)
            shutil.copytree(final, root / "incoming")
            (root / "incoming").rename(root / final.name)
            for _ in range(200):
                code, reply = await call(nc, f"{prefix}.predict", batch_map(ids, dense))
                if code == 200:
                    return final.name, reply
                await asyncio.sleep(0.1)
            raise AssertionError(f"still {code}: {reply}")
        finally:
            await nc.close()

    try:
        name, reply = asyncio.run(run())
    finally:
        codes = job.stop_all()
    assert reply["checkpoint"] == name
    assert codes["serve"] == 0, job.log("serve")[-3000:]


@pytest.mark.parametrize("args, message", [
    (["--model", "examples/adult-income/model.py:NoSuchModel"], "has no 'NoSuchModel'"),
    (["--model", "examples/adult-income/model.py:DNN", "--model-kwargs", '{"bogus": 1}'], "failed"),
    (["--model", "examples/adult-income/model.py:DNN", "--model-kwargs", "[5]"], "JSON object"),
    (["--model", "no_such_module:DNN"], "cannot import"),
    (["--model", "examples/adult-income/model.py:DNN", "--reload-interval", "-1"], "--reload-interval"),
])
def test_the_launcher_refuses_a_bad_serving_setup_with_exit_2(args, message, tmp_path, capsys, monkeypatch):
    from persia.launcher import main

    monkeypatch.chdir(ADULT.parents[1])
    code = main(["serve", "--checkpoint-dir", str(tmp_path), "--embedding-config",
                 str(ADULT / "config" / "embedding_config.yml"), "--global-config",
                 str(ADULT / "config" / "global_config.yml"), *args])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_slots_are_matched_by_name_whatever_order_a_client_sends(trained, server):
    ids, dense, _ = next(adult_data.batches(trained.test, 64))
    good = batch_map(ids, dense)
    reordered = dict(good, features=list(reversed(good["features"])))

    async def both() -> list[tuple[int, dict | str]]:
        nc = await nats.connect(server.url)
        try:
            return [await call(nc, server.predict, body) for body in (good, reordered)]
        finally:
            await nc.close()

    (code_a, a), (code_b, b) = asyncio.run(both())
    assert code_a == code_b == 200, (a, b)
    np.testing.assert_array_equal(predictions(a), predictions(b))
