"""What each NATS user of deploy/nats-auth.conf may publish and subscribe, and the code that needs it.

One table, :data:`RIGHTS`, is the source of the permission lists in deploy/nats-auth.conf and of the
table in docs/configuration.md (section Security); tests/unit/test_permissions.py checks both
against it, and checks it against the code: each right names the file whose code needs it (a
:class:`~persia_nats.common.subjects.Subjects` method called there, or a literal the code sends),
and each Subjects method a role's package calls is covered by a right of its user. A right no code
needs, or a user holding a right the table does not list, fails the test.

Job subjects are written with ``*`` for the job (one file serves any job name; give each job its own
server or account) and for replica, rank and worker ids. Replies are not a right of their own: a
responder may publish to the inboxes (``_INBOX.<user>.>``, :func:`~persia_nats.common.subjects.inbox_prefix`)
of the users that may request what it serves, and of ``admin``, derived by :func:`reply_rights`. No
user has ``allow_responses``, which would let a requester aim a reply at any subject.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from persia_nats.common.subjects import Subjects, inbox_prefix

Kind = Literal["request", "publish", "serve", "subscribe"]

#: users whose every right is listed here; ``admin`` (the operator: ``>`` both ways) is not
USERS = ("ps", "embedding-worker", "nn-worker", "data-loader", "publisher", "serving", "predict-client")
#: the user that may call anything served (persia-launcher status, checkpoint, the micro API)
OPERATOR = "admin"
#: micro service name of the role each service user registers (common.discovery)
MICRO_NAMES = {"ps": "persia-ps", "embedding-worker": "persia-embedding-worker", "nn-worker": "persia-nn-worker",
               "data-loader": "persia-data-loader", "serving": "persia-serving"}

_JOB, _ID, _WORKER = "J0B", 987654321, "W0RKER"  # placeholders turned into `*`


@dataclass(frozen=True, slots=True)
class Right:
    """One permission of one user.

    ``kind``: ``request`` (publish, with a reply to the user's inbox), ``publish`` (no reply wanted),
    ``serve`` (subscribe and answer), ``subscribe`` (read only). ``subject`` is a Subjects method name
    (``ps:update`` for ``ps(i, "update")``) or a literal subject; ``where`` is the file whose code needs
    it, ``needle`` the text of that code (default: the method's call) and ``why`` the role action.
    """

    user: str
    kind: Kind
    subject: str
    where: str
    why: str
    needle: str = ""

    @property
    def pattern(self) -> str:
        return subject_pattern(self.subject)

    @property
    def method(self) -> str | None:
        if self.subject.startswith(("$", "_INBOX")):
            return None
        return self.subject.split(":", 1)[0]


def subject_pattern(spec: str) -> str:
    """``ps:update`` -> ``persia.*.ps.*.update``; a literal (``$JS.API...``) stays as written."""
    if spec.startswith(("$", "_INBOX")):
        return spec
    name, _, verb = spec.partition(":")
    method = getattr(Subjects(_JOB), name)
    args: list[object] = []
    code = method.__code__
    for param in code.co_varnames[1:code.co_argcount]:
        annotation = method.__annotations__.get(param)
        args.append(_ID if annotation in (int, "int") else _WORKER)
    if verb:
        args[-1] = verb
    subject = method(*args)
    return ".".join("*" if token in (_JOB, str(_ID), _WORKER) else token for token in subject.split("."))


def _service(user: str, where: str, *served: tuple[str, str]) -> list[Right]:
    """The rights every service user holds: its subjects, the status broadcast and the micro API."""
    micro = MICRO_NAMES[user]
    rights = [Right(user, "serve", s, where, why) for s, why in served]
    rights += [Right(user, "serve", "srv_status", "common/discovery.py", "answer its nats.micro status endpoint"),
               Right(user, "serve", "$SRV.*", "common/discovery.py", "answer $SRV.PING/INFO/STATS of every service",
                     needle="add_endpoint("),
               Right(user, "serve", f"$SRV.*.{micro}", "common/discovery.py", f"answer $SRV.<verb>.{micro}",
                     needle="add_endpoint("),
               Right(user, "serve", f"$SRV.*.{micro}.*", "common/discovery.py", f"answer $SRV.<verb>.{micro}.<id>",
                     needle="add_endpoint("),
               Right(user, "subscribe", f"{inbox_prefix(user)}.>", "common/rpc.py", "read the replies to its requests",
                     needle="nc.request(")]
    return rights


_PS = "services/embedding_ps/service.py"
_EW = "services/embedding_worker/service.py"
_NN = "services/nn_worker/runtime.py"
_LAUNCHER = "persia/commands.py"  # persia-launcher health (health_subject)

RIGHTS: tuple[Right, ...] = (
    # embedding parameter servers
    *_service("ps", _PS, ("ps:lookup", "look up rows for the embedding workers"),
              ("ps:update", "apply the embedding workers' gradients"),
              ("ps:configure", "take the optimizer (NN rank 0) and the slot widths (embedding workers)"),
              ("ps:checkpoint", "dump and load its shard for NN rank 0's checkpoints"),
              ("ps:info", "tell its replica index and count"), ("status", "answer the status broadcast")),
    Right("ps", "publish", "hot_rows", _PS, "publish the hot rows an update asks for"),
    Right("ps", "request", "ps:info", _LAUNCHER, "`persia-launcher health embedding-parameter-server`"),
    # embedding workers
    *_service("embedding-worker", _EW, ("ew_ingest", "buffer the id features of a batch"),
              ("ew_lookup_direct", "look up an evaluation batch's embeddings"),
              ("ew_lookup", "look up a buffered batch's embeddings"), ("ew_grad", "take a batch's gradients"),
              ("ew_info", "tell its id and buffers"), ("ew_replica_info", "tell its id by replica index"),
              ("status", "answer the status broadcast")),
    Right("embedding-worker", "request", "ps:lookup", "services/embedding_worker/ps_client.py", "look up rows"),
    Right("embedding-worker", "request", "ps:update", "services/embedding_worker/ps_client.py", "push gradients"),
    Right("embedding-worker", "request", "ps:configure", "services/embedding_worker/ps_client.py",
          "tell the PSs the slot widths at start"),
    Right("embedding-worker", "request", "ps:info", "common/discovery.py", "count the PS replicas (older PSs)"),
    Right("embedding-worker", "request", "$SRV.INFO.persia-ps", "common/discovery.py", "find the PS replicas",
          needle='"INFO"'),
    Right("embedding-worker", "request", "ew_replica_info", _LAUNCHER, "`persia-launcher health embedding-worker`"),
    # NN workers
    *_service("nn-worker", _NN, ("nn_info", "tell the data loaders the world size"),
              ("nn_checkpoint", "take the operator's checkpoint request (rank 0)"),
              ("nn_rendezvous", "gather the ranks (rank 0)"), ("status", "answer the status broadcast")),
    Right("nn-worker", "serve", "nn_batch", "services/nn_worker/inbox.py", "take its batches from the data loaders"),
    Right("nn-worker", "serve", "nn_end", "services/nn_worker/inbox.py", "learn that a data loader has ended"),
    Right("nn-worker", "subscribe", "hot_rows_all", "services/nn_worker/hot_sync.py", "follow the hot rows"),
    Right("nn-worker", "subscribe", "hot_grads", "services/nn_worker/hot_sync.py", "follow the other ranks' hot grads"),
    Right("nn-worker", "publish", "hot_grads", "services/nn_worker/hot_sync.py", "announce its hot-row gradients"),
    Right("nn-worker", "publish", "trained", "services/nn_worker/stream_acks.py", "announce trained stream batches"),
    Right("nn-worker", "publish", "$JS.ACK.*.loaders.>", "services/nn_worker/stream_acks.py",
          "acknowledge the stream batches it trained", needle="ack"),
    Right("nn-worker", "request", "ew_lookup", "services/nn_worker/embedding_client.py", "look up a batch"),
    Right("nn-worker", "request", "ew_grad", "services/nn_worker/embedding_client.py", "send a batch's gradients"),
    Right("nn-worker", "request", "ew_ingest", "services/nn_worker/embedding_client.py",
          "train on batches of its own (an IterableDataset)"),
    Right("nn-worker", "request", "ew_lookup_direct", "services/nn_worker/embedding_client.py", "evaluate"),
    Right("nn-worker", "request", "ps:configure", "services/nn_worker/ctx.py", "set the embedding optimizer"),
    Right("nn-worker", "request", "ps:info", "services/nn_worker/rank_loop.py", "read the PS replicas' state"),
    Right("nn-worker", "request", "ps:checkpoint", "services/nn_worker/ps_checkpoint.py", "dump and load the PSs"),
    Right("nn-worker", "request", "nn_rendezvous", _NN, "join rank 0 (ranks > 0)"),
    Right("nn-worker", "request", "$SRV.INFO.persia-ps", "common/discovery.py", "find the PS replicas",
          needle='"INFO"'),
    Right("nn-worker", "request", "$JS.API.CONSUMER.INFO.*.loaders", "services/nn_worker/ps_checkpoint.py",
          "record the stream's position in a checkpoint", needle="consumer_info("),
    Right("nn-worker", "request", "nn_info", _LAUNCHER, "`persia-launcher health nn-worker`"),
    Right("nn-worker", "request", "$JS.API.STREAM.INFO.*", "services/nn_worker/account.py",
          "count what the stream and the dead-letter stream hold for the job's account", needle="stream_info("),
    Right("nn-worker", "request", "$JS.API.STREAM.MSG.GET.*", "services/nn_worker/account.py",
          "read the dead letters' reasons for the job's account", needle="get_msg("),
    # data loaders
    *_service("data-loader", "services/data_loader/stream_service.py"),
    Right("data-loader", "request", "ew_ingest", "services/data_loader/sender.py", "send a batch's id features"),
    Right("data-loader", "request", "nn_batch", "services/data_loader/sender.py", "send a batch to its NN rank"),
    Right("data-loader", "request", "nn_end", "services/data_loader/sender.py", "tell the NN ranks it has ended"),
    Right("data-loader", "request", "nn_info", "services/data_loader/sender.py", "learn the NN world size"),
    Right("data-loader", "publish", "dead", "services/data_loader/sender.py", "dead-letter a refused batch"),
    Right("data-loader", "request", "$JS.API.STREAM.INFO.*", "services/data_loader/stream.py",
          "find the ingestion and dead-letter streams", needle="stream_info("),
    Right("data-loader", "request", "$JS.API.STREAM.CREATE.*", "services/data_loader/stream.py",
          "create them when missing", needle="add_stream("),
    Right("data-loader", "request", "$JS.API.CONSUMER.INFO.*.loaders", "services/data_loader/stream.py",
          "find the loaders' consumer", needle="consumer_info("),
    Right("data-loader", "request", "$JS.API.CONSUMER.DURABLE.CREATE.*.loaders", "services/data_loader/stream.py",
          "create it when missing", needle="add_consumer("),
    Right("data-loader", "request", "$JS.API.CONSUMER.MSG.NEXT.*.loaders", "services/data_loader/stream.py",
          "fetch batches", needle="pull_subscribe_bind("),
    Right("data-loader", "request", "$JS.API.STREAM.MSG.GET.*", "common/dead.py",
          "read back a batch to dead-letter", needle="get_msg("),
    Right("data-loader", "publish", "$JS.ACK.*.loaders.>", "services/data_loader/stream.py",
          "give back or terminate a fetched batch", needle=".term("),
    # inference servers
    *_service("serving", "services/serving/service.py", ("serve_predict", "answer predictions"),
              ("serve_info", "tell what it serves"), ("status", "answer the status broadcast")),
    Right("serving", "request", "serve_info", _LAUNCHER, "`persia-launcher health serve`"),
    # outside users
    Right("publisher", "request", "batches", "examples/clients/publish_stream.py", "publish training batches",
          needle=".batches"),
    Right("publisher", "request", "$JS.API.STREAM.INFO.*", "docs/protocol.md",
          "check that the job's stream exists", needle="$JS.API.STREAM.INFO.*"),
    Right("publisher", "subscribe", "trained", "docs/protocol.md", "follow what was trained",
          needle="persia.<job>.trained"),
    Right("publisher", "subscribe", f"{inbox_prefix('publisher')}.>", "examples/clients/publish_stream.py",
          "read JetStream's publish acks", needle="inbox_prefix"),
    Right("predict-client", "request", "serve_predict", "examples/clients/predict_adult.py", "ask for predictions",
          needle="serve.predict"),
    Right("predict-client", "request", "serve_info", "docs/protocol.md", "ask what is served",
          needle="persia.<job>.serve.info"),
    Right("predict-client", "subscribe", f"{inbox_prefix('predict-client')}.>", "examples/clients/predict_adult.py",
          "read its replies", needle="inbox_prefix"),
)


def overlaps(a: str, b: str) -> bool:
    """Whether some subject matches both patterns (``*`` one token, ``>`` the rest)."""
    ta, tb = a.split("."), b.split(".")
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else None
        y = tb[i] if i < len(tb) else None
        if x == ">" or y == ">":
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != y and "*" not in (x, y):
            return False
    return True


def reply_rights(rights: Iterable[Right] = RIGHTS) -> dict[str, set[str]]:
    """user -> the inboxes it answers: those of every user that may request what it serves, and admin's."""
    rights = list(rights)
    out: dict[str, set[str]] = {}
    for served in (r for r in rights if r.kind == "serve"):
        callers = {r.user for r in rights if r.kind == "request" and overlaps(r.pattern, served.pattern)}
        out.setdefault(served.user, set()).update(f"{inbox_prefix(u)}.>" for u in callers | {OPERATOR})
    return out


def permissions(rights: Iterable[Right] = RIGHTS) -> dict[str, dict[str, set[str]]]:
    """user -> {"publish": patterns, "subscribe": patterns}: what deploy/nats-auth.conf must grant."""
    rights = list(rights)
    out = {user: {"publish": set[str](), "subscribe": set[str]()} for user in USERS}
    for r in rights:
        out[r.user]["publish" if r.kind in ("request", "publish") else "subscribe"].add(r.pattern)
    for user, inboxes in reply_rights(rights).items():
        out[user]["publish"] |= inboxes
    return out
