"""Credentials, TLS and per-role permissions against a real nats-server.

The permission tests run the repository's own ``deploy/nats-secure.conf`` (job ``persia``), with
throwaway passwords in the server's environment, so what is tested is what is deployed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import nats
import numpy as np
import pytest
from persia_nats.common.codec import WIRE_VERSION, array_from_wire, array_to_wire, pack
from persia_nats.common.config import embedding_config_from_dict
from persia_nats.common.env import Env, read_env
from persia_nats.common.errors import NoResponders, RequestTimeout
from persia_nats.common.messages import (
    Empty,
    EwLookup,
    GradRequest,
    IdFeature,
    IngestRequest,
    PsConfigure,
    SlotGradient,
    embeddings_from_wire,
)
from persia_nats.common.optim_config import SGDConfig, to_wire
from persia_nats.common.rpc import gather, request
from persia_nats.common.service import close_connection, connect_from_env
from persia_nats.common.subjects import EMBEDDING_WORKER_QUEUE, Subjects
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer
from persia_nats.services.embedding_worker.service import EmbeddingWorkerService
from persia_nats.services.nn_worker.ps_checkpoint import stream_position

from tests.integration.helpers import EMBEDDING, global_config, settle
from tests.natsserver import NatsServer, start_nats_server

REPO = Path(__file__).resolve().parents[2]
SECURE_CONF = REPO / "deploy" / "nats-secure.conf"
JOB = "persia"  # the job deploy/nats-secure.conf is written for
S = Subjects(JOB)
# user -> the environment variable holding its password in deploy/nats-secure.conf
PASSWORD_VARS = {"ps": "PERSIA_PS_PASSWORD", "embedding-worker": "PERSIA_EW_PASSWORD",
                 "nn-worker": "PERSIA_NN_PASSWORD", "data-loader": "PERSIA_LOADER_PASSWORD",
                 "publisher": "PERSIA_PUBLISHER_PASSWORD", "serving": "PERSIA_SERVING_PASSWORD",
                 "predict-client": "PERSIA_PREDICT_PASSWORD", "admin": "PERSIA_ADMIN_PASSWORD"}
PASSWORDS = {user: f"pw-{user}-{os.urandom(6).hex()}" for user in PASSWORD_VARS}


@pytest.fixture(scope="module")
def secure_server() -> Iterator[NatsServer]:
    yield from run_secure_server()


def run_secure_server() -> Iterator[NatsServer]:
    """deploy/nats-secure.conf and the nats.conf and nats-auth.conf it includes, copied unchanged but
    for the JetStream folder (/data in the container; the server refuses `-sd` next to a configured one)."""
    folder = Path(tempfile.mkdtemp(prefix="nats-secure-"))
    text = SECURE_CONF.read_text()
    assert text.count("store_dir: /data\n") == 1
    (folder / SECURE_CONF.name).write_text(text.replace("store_dir: /data\n", f'store_dir: "{folder}/js"\n'))
    for name in ("nats.conf", "nats-auth.conf"):
        shutil.copy(SECURE_CONF.parent / name, folder / name)
    env = {**os.environ, **{var: PASSWORDS[user] for user, var in PASSWORD_VARS.items()}}
    server = start_nats_server(conf_file=folder / SECURE_CONF.name, env=env)
    yield server
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


def role_env(server: NatsServer, user: str, password: str | None = None) -> Env:
    return read_env({"PERSIA_NATS_URL": server.url, "PERSIA_NATS_USER": user,
                     "PERSIA_NATS_PASSWORD": PASSWORDS[user] if password is None else password})


async def connect_as(server: NatsServer, user: str) -> nats.NATS:
    return await connect_from_env(role_env(server, user), f"test-{user}", connect_timeout=10)


async def publisher_client(server: NatsServer, errors: list[Exception]) -> nats.NATS:
    """The publisher as an external client would connect: plain nats-py, options from the env."""

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)

    return await nats.connect(server.url, error_cb=error_cb, allow_reconnect=False,
                              **role_env(server, "publisher").nats_options())


def lookup_msg(ids: list[int], dim: int = 4) -> dict:
    ids_wire = array_to_wire(np.asarray(ids, np.uint64))
    return {"v": WIRE_VERSION, "train": True, "groups": [{"dim": dim, "ids": ids_wire}]}


async def test_publisher_may_publish_batches_and_use_the_stream(secure_server: NatsServer) -> None:
    admin = await connect_as(secure_server, "admin")
    errors: list[Exception] = []
    pub = await publisher_client(secure_server, errors)
    try:
        got: list[bytes] = []

        async def on_batch(msg: nats.aio.msg.Msg) -> None:
            got.append(msg.data)

        sub = await admin.subscribe(S.batches(), cb=on_batch)
        await settle(admin)
        await pub.publish(S.batches(), b"batch-1")
        await pub.flush()
        for _ in range(50):
            if got:
                break
            await asyncio.sleep(0.02)
        assert got == [b"batch-1"]
        await sub.unsubscribe()
        # through JetStream: the admin (the data loader's job in production) creates the stream, the
        # publisher reads its info and gets a publish ack on its inbox
        await admin.jetstream().add_stream(name=S.stream, subjects=[S.batches()])
        js = pub.jetstream()
        assert (await js.stream_info(S.stream)).config.name == S.stream
        ack = await js.publish(S.batches(), b"batch-2", timeout=5)
        assert ack.stream == S.stream and ack.seq >= 1
        assert errors == []
    finally:
        await pub.close()
        await admin.jetstream().delete_stream(S.stream)
        await admin.close()


async def test_publisher_refused_on_internal_subjects(secure_server: NatsServer) -> None:
    ps = await connect_as(secure_server, "ps")
    ew = await connect_as(secure_server, "embedding-worker")
    errors: list[Exception] = []
    pub = await publisher_client(secure_server, errors)
    try:
        received: list[str] = []

        async def record(msg: nats.aio.msg.Msg) -> None:
            received.append(msg.subject)

        await ps.subscribe(S.ps(0, "update"), cb=record)
        await ew.subscribe(S.ew_ingest(), queue=EMBEDDING_WORKER_QUEUE, cb=record)
        await settle(ps, ew)
        for subject in (S.ps(0, "update"), S.ew_ingest(), S.nn_batch(0), S.dead(), S.trained()):
            await pub.publish(subject, b"\x80")
        await pub.flush()
        await pub.publish(S.batches(), b"still allowed")  # the connection survives the refusals
        await pub.flush()
        for _ in range(100):
            if len(errors) >= 5:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # what would have been delivered has arrived by now
        assert received == []
        refused = " ".join(str(e) for e in errors)
        for subject in (S.ps(0, "update"), S.ew_ingest(), S.nn_batch(0), S.dead(), S.trained()):
            assert f'permissions violation for publish to "{subject}"' in refused.lower()
        assert pub.is_connected
        # it may not read internal traffic either
        errors.clear()
        await pub.subscribe(S.ps(0, "lookup"))
        await settle(pub)
        for _ in range(100):
            if errors:
                break
            await asyncio.sleep(0.02)
        assert f'permissions violation for subscription to "{S.ps(0, "lookup")}"' in str(errors[0]).lower()
        # the subscriptions were live all along: the same messages from a user allowed to send them arrive
        admin = await connect_as(secure_server, "admin")
        await admin.publish(S.ps(0, "update"), b"\x80")
        await admin.publish(S.ew_ingest(), b"\x80")
        await admin.close()
        for _ in range(100):
            if len(received) == 2:
                break
            await asyncio.sleep(0.02)
        assert sorted(received) == sorted([S.ps(0, "update"), S.ew_ingest()])
    finally:
        for nc in (pub, ps, ew):
            await nc.close()


async def test_stream_path_under_the_role_users(secure_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """The durable path's JetStream calls, each under the user that makes it in a job: the data
    loader creates the streams and its consumer, fetches and dead-letters; the NN worker acks and
    announces; the publisher publishes."""
    loader = await connect_as(secure_server, "data-loader")
    nn = await connect_as(secure_server, "nn-worker")
    admin = await connect_as(secure_server, "admin")
    errors: list[Exception] = []
    pub = await publisher_client(secure_server, errors)
    js = loader.jetstream()
    try:
        await js.add_stream(name=S.stream, subjects=[S.batches()])
        await js.add_stream(name=S.dead_stream, subjects=[S.dead()])
        await js.add_consumer(S.stream, durable_name=S.stream_consumer, ack_policy="explicit", ack_wait=30)
        for data in (b"good", b"bad"):
            await pub.jetstream().publish(S.batches(), data, timeout=5)
        sub = await js.pull_subscribe_bind(durable=S.stream_consumer, stream=S.stream)
        good, bad = await sub.fetch(2, timeout=5)
        assert (good.data, bad.data) == (b"good", b"bad")
        # a refused batch: into the dead-letter stream, then terminated
        await js.publish(S.dead(), bad.data, headers={"Persia-Refused": "400 test"}, timeout=5)
        await bad.term()
        # a trained batch: the NN worker acknowledges it on its $JS.ACK subject and announces it
        notices = await admin.subscribe(S.trained())
        await settle(admin)
        await nn.publish(good.reply, b"+ACK")
        await nn.publish(S.trained(), b"\x80")
        await nn.flush()
        assert (await notices.next_msg(timeout=5)).data == b"\x80"
        for _ in range(100):
            info = await js.consumer_info(S.stream, S.stream_consumer)
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert info.num_ack_pending == 0 and info.num_pending == 0
        assert (await js.stream_info(S.dead_stream)).state.messages == 1
        # the NN worker's checkpoint records the consumer's position, read under its own user (without
        # the permission the read waited out its 5 s timeout at every checkpoint and recorded nothing)
        started = time.monotonic()
        position = await stream_position(SimpleNamespace(nc=nn, subjects=S))
        assert position == {"stream": S.stream, "consumer": S.stream_consumer, "ack_floor": 2, "delivered": 2,
                            "ack_pending": 0, "pending": 0}
        assert time.monotonic() - started < 2
        assert errors == []
        # a user the server does not let read it: the checkpoint records no position, and says so
        with caplog.at_level("WARNING", logger="persia_nats.services.nn_worker.checkpoint"):
            assert await stream_position(SimpleNamespace(nc=pub, subjects=S)) is None
        assert any("position could not be read" in r.getMessage() and S.stream in r.getMessage()
                   for r in caplog.records), caplog.text
        assert 'permissions violation for publish to "$js.api.consumer.info.' in str(errors).lower()
    finally:
        for name in (S.stream, S.dead_stream):
            try:
                await admin.jetstream().delete_stream(name)
            except Exception:  # not created: the test failed before
                pass
        for nc in (pub, loader, nn, admin):
            await nc.close()


async def test_an_inference_server_answers_prediction_clients_under_their_own_users(
        secure_server: NatsServer, tmp_path: Path) -> None:
    """``persia-launcher serve`` as a deployment runs it, under `serving`, answers a client holding the
    `predict-client` password (info, and a predict: 400 for a malformed batch, which is an answer); that
    client may publish nothing else, and the batch publisher may not ask for predictions."""
    from tests.procs import Job, job_env, launcher_cmd

    env = job_env(secure_server.url, JOB, PERSIA_NATS_USER="serving", PERSIA_NATS_PASSWORD=PASSWORDS["serving"])
    job = Job(env, tmp_path)
    (tmp_path / "ckpt").mkdir()
    job.start("serve", "serve", "--checkpoint-dir", str(tmp_path / "ckpt"), "--model",
              "examples/adult-income/model.py:DNN", "--model-kwargs", '{"dense_dim": 5}', "--reload-interval", "0")
    errors: list[Exception] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)

    client = await nats.connect(secure_server.url, error_cb=error_cb, allow_reconnect=False,
                                **role_env(secure_server, "predict-client").nats_options())
    pub_errors: list[Exception] = []
    pub = await publisher_client(secure_server, pub_errors)
    try:
        for _ in range(600):  # until the server has loaded its kernels and subscribed
            try:
                info = await request(client, S.serve_info(), Empty(), 1)
                break
            except (NoResponders, RequestTimeout):
                assert job.procs["serve"].poll() is None, job.log("serve")[-3000:]
                await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the inference server never answered:\n{job.log('serve')[-3000:]}")
        assert info["instance"].startswith("serve-0-"), info
        # issue 38 (8): the server's checkpoint path is not told to a client
        assert str(tmp_path) not in repr(info) and "checkpoint_dir" not in info, info
        # its container's health checks, under its own user: live, and not ready with no checkpoint to serve
        health = await asyncio.to_thread(subprocess.run, launcher_cmd("health", "serve", "--timeout", "5", "--live"),
                                         env=env, capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and '"instance": "serve-0-' in health.stdout, health.stderr
        health = await asyncio.to_thread(subprocess.run, launcher_cmd("health", "serve", "--timeout", "5"), env=env,
                                         capture_output=True, text=True, timeout=60)
        assert health.returncode == 1 and "not ready: serve" in health.stderr, (health.stdout, health.stderr)
        reply = await client.request(S.serve_predict(), b"\x80", timeout=5)
        assert (reply.headers or {}).get("Nats-Service-Error-Code") == "400", reply.headers
        assert errors == []
        # a prediction client is refused everywhere else, the publisher on the inference subjects
        await client.publish(S.batches(), b"\x80")
        await pub.publish(S.serve_predict(), b"\x80")
        await client.flush()
        await pub.flush()
        for _ in range(100):
            if errors and pub_errors:
                break
            await asyncio.sleep(0.02)
        assert f'permissions violation for publish to "{S.batches()}"' in str(errors[0]).lower()
        assert f'permissions violation for publish to "{S.serve_predict()}"' in str(pub_errors[0]).lower()
    finally:
        await client.close()
        await pub.close()
        codes = job.stop_all()
    assert codes["serve"] == 0, job.log("serve")[-3000:]
    assert "permissions violation" not in job.log("serve").lower(), job.log("serve")[-3000:]


async def test_wrong_password_fails_fast_with_a_clear_error(secure_server: NatsServer) -> None:
    env = role_env(secure_server, "ps", password="not-the-password")
    start = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        await connect_from_env(env, "ps-0", connect_timeout=30)
    assert time.monotonic() - start < 5  # not retried until connect_timeout
    message = str(info.value)
    assert "authorization violation" in message.lower() and "'ps-0'" in message and "PERSIA_NATS_USER" in message
    assert "not-the-password" not in message
    # an unknown user, and no credentials at all, are refused the same way
    nobody = {"PERSIA_NATS_URL": secure_server.url, "PERSIA_NATS_USER": "nobody", "PERSIA_NATS_PASSWORD": "x"}
    for bad in (read_env(nobody), read_env({"PERSIA_NATS_URL": secure_server.url})):
        with pytest.raises(ConnectionError, match="(?i)authorization violation"):
            await connect_from_env(bad, "anonymous", connect_timeout=30)


async def test_roles_serve_each_other_under_their_own_users(secure_server: NatsServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A PS under `ps`, an embedding worker under `embedding-worker`; the NN worker's and the data
    loader's requests under theirs; status under `admin`; health checks under each role's user; the
    hot rows the PS publishes reach the NN worker."""
    gcfg = global_config(JOB, hot_row_min_count=2)
    ps_nc = await connect_as(secure_server, "ps")
    ew_nc = await connect_as(secure_server, "embedding-worker")
    nn = await connect_as(secure_server, "nn-worker")
    loader = await connect_as(secure_server, "data-loader")
    admin = await connect_as(secure_server, "admin")
    ps = EmbeddingParameterServer(ps_nc, gcfg, 0, 1)
    ew = EmbeddingWorkerService(ew_nc, gcfg, embedding_config_from_dict(EMBEDDING), 0, ps_wait_s=10)
    try:
        await ps.start()
        await settle(ps_nc)
        # the embedding worker user looks rows up on the PS
        rows = array_from_wire((await request(ew_nc, S.ps(0, "lookup"), lookup_msg([1, 2]), 5))["groups"][0], "g")
        assert rows.shape == (2, 4) and len(ps.store) == 2
        await ew.start()
        await settle(ew_nc)
        # the NN worker configures the PS; the data loader ingests; the NN worker looks the batch up
        await request(nn, S.ps(0, "configure"), PsConfigure(SGDConfig(lr=1.0)), 5)
        feature = IdFeature("a", np.array([1, 2, 1], np.uint64), np.array([2, 1], np.int32))
        raw = IdFeature("r", np.array([], np.uint64), np.zeros(2, np.int32))
        ref = await request(loader, S.ew_ingest(), IngestRequest((feature, raw), True).to_wire(), 5)
        reply = await request(nn, S.ew_lookup(ref["worker"]), EwLookup(ref["ref"], train=True), 5)
        emb, _ = embeddings_from_wire(reply["embeddings"])
        assert emb.emb.shape == (2, 4) and reply["hot"]["slots"] == ["a"]  # id 1 is read twice
        published: list[str] = []

        async def on_rows(msg: nats.aio.msg.Msg) -> None:
            published.append(msg.subject)

        await nn.subscribe(S.hot_rows_all(), cb=on_rows)
        await settle(nn)
        grads = GradRequest(ref["ref"], (SlotGradient("a", np.ones((2, 4), np.float16)),)).to_wire()
        await request(nn, S.ew_grad(ref["worker"]), grads, 5)
        for _ in range(100):
            if published:
                break
            await asyncio.sleep(0.02)
        assert published == [S.hot_rows(0)] and ps.publish_failures == 0
        # the status broadcast reaches both services and their replies come back to the admin
        replies = await gather(admin, S.status(), Empty(), 1.0)
        assert sorted(r["role"] for r in replies) == sorted([ps.role, ew.role])
        # the launcher's health checks, each under its role's user
        from persia.launcher import main

        monkeypatch.setenv("PERSIA_JOB_NAME", JOB)
        monkeypatch.setenv("PERSIA_NATS_URL", secure_server.url)
        for user, target in (("ps", "embedding-parameter-server"), ("embedding-worker", "embedding-worker")):
            monkeypatch.setenv("PERSIA_NATS_USER", user)
            monkeypatch.setenv("PERSIA_NATS_PASSWORD", PASSWORDS[user])
            assert await asyncio.to_thread(main, ["health", target, "--timeout", "5"]) == 0
        monkeypatch.setenv("PERSIA_NATS_PASSWORD", "wrong")
        assert await asyncio.to_thread(main, ["health", "embedding-worker", "--timeout", "5"]) == 1
    finally:
        await ew.stop(drain_timeout=5)
        await ps.stop(drain_timeout=5)
        for nc in (ps_nc, ew_nc, nn, loader, admin):
            await close_connection(nc)


# --- a whole job under the secure configuration, and a publisher forging its internal messages ---


@pytest.mark.slow  # the whole adult job, every role its own process
async def test_adult_job_trains_under_per_role_users_and_every_forged_message_is_refused(
        secure_server: NatsServer, tmp_path: Path) -> None:
    """The adult job, every role a real process under its own user (what compose and k8s run), while
    a client holding the publisher's password forges the messages that, on an open server, end a
    rank's stream (AUC 0.53), freeze the embeddings (update ids claimed in advance), reconfigure a PS
    (SGD lr 1e6) and steal batches (lookups of predicted refs). Each is refused by the server and
    reported to the forger; the job trains every sample to its usual AUC; no PS saw a duplicate update
    or a configure it had to refuse."""
    from tests.procs import ADULT, Job, job_env

    users = {"ps0": "ps", "ps1": "ps", "ew0": "embedding-worker", "nn": "nn-worker", "loader": "data-loader"}
    job = Job(job_env(secure_server.url, JOB, EMBEDDING_STALENESS="10"), tmp_path)
    admin = await connect_as(secure_server, "admin")
    errors: list[Exception] = []
    pub = await publisher_client(secure_server, errors)
    try:
        for i in range(2):
            job.start(f"ps{i}", "embedding-parameter-server", "--replica-index", str(i), "--replica-size", "2",
                      extra_env={"PERSIA_NATS_USER": "ps", "PERSIA_NATS_PASSWORD": PASSWORDS["ps"]})
        for name, args in (("ew0", ("embedding-worker", "--replica-index", "0", "--replica-size", "1")),
                           ("nn", ("nn-worker", str(ADULT / "train.py"))),
                           ("loader", ("data-loader", str(ADULT / "data_loader.py")))):
            job.start(name, *args, extra_env={"PERSIA_NATS_USER": users[name],
                                              "PERSIA_NATS_PASSWORD": PASSWORDS[users[name]]})
        # forge while the job trains: once the embedding worker has ingested and looked up batches
        worker, looked_up = None, 0
        for _ in range(600):
            assert job.procs["nn"].poll() is None, job.dump_logs()
            replies = await gather(admin, S.status(), {"v": WIRE_VERSION}, 0.5)
            ew = [r for r in replies if r.get("role") == "embedding-worker"]
            if ew:
                worker, looked_up = ew[0]["stats"].get("worker"), ew[0]["stats"].get("looked_up", 0)
            if worker and looked_up >= 5:
                break
            await asyncio.sleep(0.2)
        assert worker and looked_up >= 5, job.dump_logs()
        forged: list[tuple[str, dict]] = [
            (S.nn_end(0), {"v": WIRE_VERSION, "final": True}),
            (S.nn_end(0), {"v": WIRE_VERSION, "loader_index": 0, "loader_size": 2**62, "batches": 0}),
            (S.ps(0, "configure"), {"v": WIRE_VERSION, "optimizer": to_wire(SGDConfig(lr=1e6))}),
        ]
        # the update ids of the next refs, as they would be guessed (the worker id is public)
        for i in range(2):
            forged += [(S.ps(i, "update"), {"v": WIRE_VERSION, "id": f"{worker}.{ref}", "groups": []})
                       for ref in range(looked_up, looked_up + 3)]
        forged += [(S.ew_lookup(worker), {"v": WIRE_VERSION, "ref": ref, "train": True})
                   for ref in range(looked_up, looked_up + 3)]
        for subject, message in forged:
            await pub.publish(subject, pack(message))
        await pub.flush()
        for _ in range(200):
            if len(errors) >= len(forged):
                break
            await asyncio.sleep(0.05)
        refused = [str(e).lower() for e in errors]
        assert len(refused) == len(forged), refused
        for subject, _ in forged:
            assert any(f'permissions violation for publish to "{subject}"' in e for e in refused), subject
        assert pub.is_connected  # refused, not disconnected: the publisher's own batches still go

        assert await asyncio.to_thread(job.wait, "nn", 300) == 0, job.dump_logs()
        assert await asyncio.to_thread(job.wait, "loader", 30) == 0, job.dump_logs()
        result = job.json_result("nn")
        assert result["train_samples"] == 32561 and result["test_samples"] == 16281, result
        assert result["test_auc"] >= 0.89, result
        assert result["counters"].get("grads_applied") == result["steps"], result
        ps = [r for r in await gather(admin, S.status(), {"v": WIRE_VERSION}, 1.0)
              if r.get("role") == "embedding-parameter-server"]
        assert len(ps) == 2, ps
        for r in ps:
            assert r["stats"]["duplicate_updates"] == 0 and r["stats"]["configure_refused"] == 0, r
    finally:
        await pub.close()
        await admin.close()
        codes = job.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, job.dump_logs())


# --- token authentication and TLS ---------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _pki_openssl(folder: Path) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=persia test CA",
             "-keyout", "ca.key", "-out", "ca.pem", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    for name, usage, san in (("server", "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"),
                             ("client", "clientAuth", "")):
        (folder / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={usage}\nauthorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n{san}")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=persia test {name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=folder)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)


def _pki_cryptography(folder: Path) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def write(name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        (folder / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def build(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey,
              ca: bool) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                               critical=False))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "persia test CA")])
    ca = (build("persia test CA", ca_key, ca_name, ca_key, ca=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    write("ca", ca_key, ca)
    for name, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = build(f"persia test {name}", key, ca_name, ca_key, ca=False).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False)
        if name == "server":
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        write(name, key, builder.sign(ca_key, hashes.SHA256()))


def make_pki(folder: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate, made
    with the cryptography package when it is installed, else with the openssl command."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        _pki_openssl(folder)
    else:
        _pki_cryptography(folder)
    return {n: folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def pki() -> Iterator[dict[str, Path]]:
    folder = Path(tempfile.mkdtemp(prefix="persia-pki-"))
    try:
        yield make_pki(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def tls_block(pki: dict[str, Path], verify_clients: bool = False) -> str:
    return (f'tls {{\n  cert_file: "{pki["server.pem"]}"\n  key_file: "{pki["server.key"]}"\n'
            f'  ca_file: "{pki["ca.pem"]}"\n  verify: {str(verify_clients).lower()}\n  timeout: 2\n}}\n')


async def roundtrip(nc: nats.NATS) -> None:
    sub = await nc.subscribe("persia.tls.echo")
    await settle(nc)
    await nc.publish("persia.tls.echo", b"hi")
    assert (await sub.next_msg(timeout=5)).data == b"hi"


async def test_token_auth_over_tls_with_the_ca_alone(pki: dict[str, Path]) -> None:
    server = start_nats_server('authorization { token: "tok-s3cret" }\n' + tls_block(pki))
    try:
        for url in (f"tls://127.0.0.1:{server.port}", server.url):  # nats:// upgrades when the server needs TLS
            env = read_env({"PERSIA_NATS_URL": url, "PERSIA_NATS_TOKEN": "tok-s3cret",
                            "PERSIA_NATS_TLS_CA": str(pki["ca.pem"])})
            nc = await connect_from_env(env, "tls-client", connect_timeout=10)
            try:
                await roundtrip(nc)
            finally:
                await nc.close()
        # a wrong token is refused at once
        bad = read_env({"PERSIA_NATS_URL": f"tls://127.0.0.1:{server.port}", "PERSIA_NATS_TOKEN": "wrong",
                        "PERSIA_NATS_TLS_CA": str(pki["ca.pem"])})
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="(?i)authorization violation"):
            await connect_from_env(bad, "tls-client", connect_timeout=30)
        assert time.monotonic() - start < 5
        # without our CA the server's certificate does not verify: refused at once too
        untrusted = read_env({"PERSIA_NATS_URL": f"tls://127.0.0.1:{server.port}", "PERSIA_NATS_TOKEN": "tok-s3cret"})
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="(?i)certificate verify failed"):
            await connect_from_env(untrusted, "tls-client", connect_timeout=30)
        assert time.monotonic() - start < 5
    finally:
        server.stop()


async def test_client_certificate_when_the_server_verifies_clients(pki: dict[str, Path]) -> None:
    server = start_nats_server(tls_block(pki, verify_clients=True))
    try:
        env = read_env({"PERSIA_NATS_URL": f"tls://localhost:{server.port}", "PERSIA_NATS_TLS_CA": str(pki["ca.pem"]),
                        "PERSIA_NATS_TLS_CERT": str(pki["client.pem"]), "PERSIA_NATS_TLS_KEY": str(pki["client.key"])})
        nc = await connect_from_env(env, "mtls-client", connect_timeout=10)
        try:
            await roundtrip(nc)
        finally:
            await nc.close()
        no_cert = read_env({"PERSIA_NATS_URL": f"tls://localhost:{server.port}",
                            "PERSIA_NATS_TLS_CA": str(pki["ca.pem"])})
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="(?i)certificate required"):
            await connect_from_env(no_cert, "mtls-client", connect_timeout=30)
        assert time.monotonic() - start < 5
    finally:
        server.stop()


# --- connect(): bounded start-up, nothing secret in its errors ---------------------------------


async def test_connect_gives_up_after_connect_timeout_without_leaking_url_credentials() -> None:
    import socket

    from persia_nats.common.service import connect

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        await connect([f"nats://ps:url-s3cret@127.0.0.1:{port}"], "ps-0", connect_timeout=1.0)
    assert 0.9 < time.monotonic() - start < 4
    assert "within 1s" in str(info.value) and "url-s3cret" not in str(info.value)
    assert f"nats://***@127.0.0.1:{port}" in str(info.value)
