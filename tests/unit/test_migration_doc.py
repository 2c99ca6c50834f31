"""docs/migrating-from-persia.md stays true: every row's mark is what the code does with that PERSIA name.

The marks are derived from the code itself (the config classes' PERSIA keys, ``persia.env.PERSIA_ONLY_VARS``,
``persia.nn_contexts.NO_EFFECT`` and ``REFUSED_METHODS``, ``persia.ctx.persia_names()``, ``persia.prelude.INSTEAD``,
the launcher's own parser, and what each API name does when looked up), so a name the code starts to treat
otherwise, or a PERSIA name the code learns without a row, fails here naming it. The lists of PERSIA's own names
below come from its code (``persia-embedding-config/src/lib.rs``, ``persia/launcher.py``, ``persia/ctx.py``) and
docs, as ``/work/shared/reference/persia-reference.md`` records them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import re
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from persia_nats.common.config import (
    CommonConfig,
    EmbeddingConfig,
    GlobalConfig,
    MetricsConfig,
    global_config_from_dict,
)
from persia_nats.common.config_schema import Renamed
from persia_nats.common.env import read_env
from persia_nats.common.errors import ConfigError
from persia_nats.common.storage import check_root

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "migrating-from-persia.md"
SOURCES = ("common", "core", "dense", "services", "persia")

#: figures row -> the section whose tables it counts
SECTIONS = {"config keys": "## Config keys", "environment variables": "## Environment variables",
            "launcher subcommands and flags": "## persia-launcher", "API names": "## Python API",
            "behaviours": "## Behaviours"}

#: the keys of PERSIA's code (persia-embedding-config) and of its docs and examples
PERSIA_CONFIG_KEYS = {
    "common_config.metrics_config.enable_metrics", "common_config.metrics_config.job_name",
    "common_config.metrics_config.push_interval_seconds", "common_config.metrics_config.push_interval_sec",
    "common_config.job_type", "common_config.infer_config.servers", "common_config.infer_config.embedding_checkpoint",
    "common_config.infer_config.initial_sparse_checkpoint", "common_config.checkpointing_config.num_workers",
    "embedding_parameter_server_config.capacity", "embedding_parameter_server_config.num_hashmap_internal_shards",
    "embedding_parameter_server_config.enable_incremental_update",
    "embedding_parameter_server_config.incremental_buffer_size", "embedding_parameter_server_config.incremental_dir",
    "embedding_parameter_server_config.incremental_channel_capacity",
    "embedding_parameter_server_config.full_amount_manager_buffer_size",
    "embedding_worker_config.forward_buffer_size", "embedding_worker_config.buffered_data_expired_sec",
    "PersiaMetricsConfig", "feature_index_prefix_bit", "slots_config", "slot_config", "feature_groups",
    "slots_config.<slot>.dim", "slots_config.<slot>.sample_fixed_size", "slots_config.<slot>.embedding_summation",
    "slots_config.<slot>.sqrt_scaling", "slots_config.<slot>.hash_stack_config.hash_stack_rounds",
    "slots_config.<slot>.hash_stack_config.embedding_size", "slots_config.<slot>.index_prefix",
    "slots_config.<slot>.capacity",
}
#: the variables PERSIA's processes, launcher and examples read
PERSIA_VARIABLES = {
    "PERSIA_NATS_URL", "PERSIA_NATS_IP", "PERSIA_GLOBAL_CONFIG", "PERSIA_EMBEDDING_CONFIG", "PERSIA_NN_WORKER_ENTRY",
    "PERSIA_DATALOADER_ENTRY", "REPLICA_INDEX", "REPLICA_SIZE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOG_LEVEL",
    "PERSIA_SOCKET_IFNAME", "PERSIA_METRICS_GATEWAY_ADDR", "PERSIA_SCHEDULED_THREAD_POOL_SIZE",
    "PERSIA_DEADLOCK_DETECTION", "PERSIA_SKIP_CHECK_DATA", "PERSIA_LAUNCHER_VERBOSE", "EMBEDDING_WORKER_SERVICE",
    "PERSIA_CKPT_DIR", "REPRODUCIBLE", "EMBEDDING_STALENESS", "CUBLAS_WORKSPACE_CONFIG", "NCCL_SOCKET_IFNAME",
    "NPROC_PER_NODE",
}
#: variables that a PERSIA job's own scripts, its shell or torch read, not this project's code: their mark
READ_ELSEWHERE = {"EMBEDDING_STALENESS": "same", "REPRODUCIBLE": "warned", "NPROC_PER_NODE": "same",
                  "CUBLAS_WORKSPACE_CONFIG": "same", "NCCL_SOCKET_IFNAME": "same"}
#: PERSIA's persia-launcher: subcommand -> its flags (FILEPATH: the script argument)
PERSIA_LAUNCHER = {
    "nn-worker": ("FILEPATH", "--nproc-per-node", "--node-rank", "--nnodes"),
    "data-loader": ("FILEPATH", "--replica-index", "--replica-size"),
    "embedding-worker": ("--port", "--embedding-config", "--global-config", "--replica-index", "--replica-size"),
    "embedding-parameter-server": ("--port", "--embedding-config", "--global-config", "--replica-index",
                                   "--replica-size"),
    "trainer": (), "compose": (), "middleware": (), "server": (),  # PERSIA 0.1's names
}
#: the arguments PERSIA's TrainCtx takes, its base contexts' included
PERSIA_TRAIN_CTX_ARGS = {"embedding_optimizer", "dense_optimizer", "grad_scalar_update_factor", "backward_buffer_size",
                         "backward_workers_size", "grad_update_buffer_size", "lookup_emb_directly", "mixed_precision",
                         "distributed_option", "model", "embedding_config", "device_id", "threadpool_worker_size"}


@dataclasses.dataclass(frozen=True)
class Mark:
    kind: str  # same, mapped, warned, refused
    to: str = ""

    def __str__(self) -> str:
        return f"mapped to `{self.to}`" if self.kind == "mapped" else self.kind


SAME, WARNED, REFUSED = Mark("same"), Mark("warned"), Mark("refused")


def parse_mark(cell: str) -> Mark:
    if cell in ("same", "warned", "refused"):
        return Mark(cell)
    m = re.fullmatch(r"mapped to `([^`]+)`", cell)
    assert m, f"{DOC.name}: {cell!r} is not a mark (same, mapped to `X`, warned, refused)"
    return Mark("mapped", m.group(1))


def section(heading: str) -> str:
    text = DOC.read_text()
    start = text.index(heading + "\n")
    nxt = re.search(r"^## ", text[start + len(heading):], flags=re.M)
    return text[start: start + len(heading) + nxt.start()] if nxt else text[start:]


def rows(heading: str) -> dict[str, Mark]:
    """PERSIA name -> its mark, from every table row under ``heading`` (its sub-headings included)."""
    out: dict[str, Mark] = {}
    for line in section(heading).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and (m := re.fullmatch(r"`([^`]+)`", cells[0])):
            assert m.group(1) not in out, f"{DOC.name}: {m.group(1)} has two rows"
            out[m.group(1)] = parse_mark(cells[1])
    return out


def wrong_marks(table: dict[str, Mark], truth: typing.Callable[[str], Mark]) -> list[str]:
    return [f"{name}: the page says {mark}, the code {truth(name)}" for name, mark in table.items()
            if truth(name) != mark]


# ----- config keys -----------------------------------------------------------------------------------


def classes(cls: type, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(dotted prefix, class) of a config dataclass and every one nested in it (a slot as ``<slot>``)."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind, name = hints[f.name], f.name
        if typing.get_origin(kind) is Mapping:
            kind, name = typing.get_args(kind)[1], f"{f.name}.<slot>"
        if dataclasses.is_dataclass(kind):
            yield from classes(kind, f"{prefix}{name}.")  # type: ignore[arg-type]


@functools.cache
def config_truth() -> dict[str, Mark]:
    truth: dict[str, Mark] = {}
    for root in (GlobalConfig, EmbeddingConfig):
        for prefix, cls in classes(root):
            truth |= {prefix + f.name: SAME for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
            truth |= {prefix + k: WARNED for k in getattr(cls, "_unused_keys", {})}
            truth |= {prefix + k: REFUSED for k in getattr(cls, "_derived_keys", {})}
            truth |= {prefix + k: Mark("mapped", prefix + rule.to) if isinstance(rule, Renamed) else WARNED
                      for k, rule in getattr(cls, "_persia_keys", {}).items()}
    return truth


def config_key_mark(key: str) -> Mark:
    return config_truth().get(key, Mark("unknown to the code"))


def test_every_persia_config_key_has_its_mark() -> None:
    table = rows("## Config keys")
    truth = config_truth()
    handled = {k for k, mark in truth.items() if mark != SAME}  # every key the code maps, warns of or refuses
    missing = sorted((handled | PERSIA_CONFIG_KEYS) - set(table))
    assert not missing, f"{DOC.name}: PERSIA config keys without a row: {missing}"
    wrong = wrong_marks(table, config_key_mark)
    assert not wrong, f"{DOC.name}: " + "; ".join(wrong)


# ----- environment variables -----------------------------------------------------------------------------


@functools.cache
def our_literals() -> frozenset[str]:
    """Every quoted upper-case name in this project's code: the variables it may read."""
    names: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']", path.read_text()))
    return frozenset(names)


def reads_as_nats_url(name: str) -> bool:
    url = "nats://persia-host:4000"
    try:
        return read_env({name: url}) == read_env({"PERSIA_NATS_URL": url}) != read_env({})
    except ConfigError:  # a variable of another kind (a count, a path)
        return False


def variable_mark(name: str) -> Mark:
    from persia.env import PERSIA_ONLY_VARS, persia_only_vars

    if name in PERSIA_ONLY_VARS or persia_only_vars({name: "x"}):
        return WARNED
    if name != "PERSIA_NATS_URL" and reads_as_nats_url(name):
        return Mark("mapped", "PERSIA_NATS_URL")
    if name in READ_ELSEWHERE:
        return Mark(READ_ELSEWHERE[name])
    return SAME if name in our_literals() else Mark("read by nothing here")


def test_every_persia_variable_has_its_mark() -> None:
    from persia.env import PERSIA_ONLY_VARS

    table = rows("## Environment variables")
    missing = sorted((PERSIA_VARIABLES | set(PERSIA_ONLY_VARS) | {"PERSIA_CKPT_DIR"}) - set(table))
    assert not missing, f"{DOC.name}: PERSIA variables without a row: {missing}"
    wrong = wrong_marks(table, variable_mark)
    assert not wrong, f"{DOC.name}: " + "; ".join(wrong)


def test_every_persia_prefixed_variable_of_ours_is_named() -> None:
    text = section("## Environment variables")
    read = set()
    for module in ("persia_nats.common.env", "persia.env"):
        source = inspect.getsource(importlib.import_module(module))
        # a module's own constants (PERSIA_ONLY_VARS) are names in code, not variables
        read |= {n for n in re.findall(r"\bPERSIA_[A-Z0-9_]*[A-Z0-9]\b", source)
                 if not hasattr(importlib.import_module(module), n)}
    missing = sorted(name for name in read if f"`{name}`" not in text)
    assert not missing, f"{DOC.name}, Environment variables: not named: {missing}"


# ----- persia-launcher ---------------------------------------------------------------------------------


@functools.cache
def launcher_help(subcommand: str) -> str | None:
    """``persia-launcher SUBCOMMAND --help``, or None when there is no such subcommand."""
    from persia.launcher import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main([subcommand, "--help"])
    return out.getvalue() if exit_.value.code == 0 else None


def launcher_flags(subcommand: str) -> set[str]:
    """The flags (and ``FILEPATH``) of the usage lines of a subcommand's help."""
    text = launcher_help(subcommand) or ""
    usage = text.split("\n\n", 1)[0]
    return set(re.findall(r"\[(--[a-z][a-z-]*)", usage)) | ({"FILEPATH"} if "[filepath]" in usage else set())


def launcher_mark(command: str) -> Mark:
    _, subcommand, *flag = command.split()
    help_text = launcher_help(subcommand)
    if help_text is None or (flag and flag[0] not in launcher_flags(subcommand)):
        return REFUSED
    mapped = rows("## persia-launcher")[command]
    if mapped.kind == "mapped" and mapped.to in help_text:  # the flag's help names what it sets
        return mapped
    return SAME


def test_every_persia_launcher_flag_has_its_mark() -> None:
    table = rows("## persia-launcher")
    wanted = {f"persia-launcher {sub}" for sub in PERSIA_LAUNCHER}
    wanted |= {f"persia-launcher {sub} {flag}" for sub, flags in PERSIA_LAUNCHER.items() for flag in flags}
    missing = sorted(wanted - set(table))
    assert not missing, f"{DOC.name}: PERSIA launcher commands without a row: {missing}"
    wrong = wrong_marks(table, launcher_mark)
    assert not wrong, f"{DOC.name}: " + "; ".join(wrong)


def test_every_flag_of_persias_subcommands_is_named() -> None:
    text = section("## persia-launcher")
    unnamed = sorted(f"{sub} {flag}" for sub, flags in PERSIA_LAUNCHER.items() if flags
                     for flag in launcher_flags(sub) if f"{sub} {flag}`" not in text and f"`{flag}`" not in text)
    assert not unnamed, f"{DOC.name}, persia-launcher: flags the launcher accepts but the page does not name: {unnamed}"


# ----- the Python API ----------------------------------------------------------------------------------


def resolve(dotted: str) -> object:
    """The object a script reaches by ``dotted``: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def refuses_when_called(obj: object) -> bool:
    try:
        source = inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    if "NotImplementedError" not in source or not callable(obj):
        return False
    for args in ((), ("x",)):
        try:
            obj(*args)
        except NotImplementedError:
            return True
        except TypeError:
            continue
    return False


def accepted(obj: object) -> set[str]:
    """The named parameters of a function, or of a class's constructors along its MRO."""
    funcs = [c.__init__ for c in obj.__mro__ if "__init__" in vars(c)] if inspect.isclass(obj) else [obj]
    names: set[str] = set()
    for func in funcs:
        try:
            params = inspect.signature(func).parameters.values()  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        names |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"}
    return names


#: a value other than PERSIA's default for each of DDPOption's options
DDP_SAMPLES = {"init_method": "file", "backend": "gloo", "master_port": 1234, "master_addr": "10.0.0.1",
               "sync_file": "/tmp/ddp-sync"}


def argument_mark(owner: str, arg: str) -> Mark:
    from persia.distributed import DDPOption
    from persia.nn_contexts import DUMP_ORDER, DUMP_ORDER_EARLIER, NO_EFFECT, TRAIN_POSITIONAL

    obj = resolve(owner)
    if owner == "persia.distributed.DDPOption":
        try:
            option = DDPOption(**{arg: DDP_SAMPLES.get(arg, "x")})
        except (TypeError, ValueError):
            return REFUSED
        return WARNED if option.no_effect() or said_no_effect("DDPOption", arg) else SAME
    names = accepted(obj) | (set(TRAIN_POSITIONAL) if owner == "persia.ctx.TrainCtx" else set())
    if owner == "persia.ctx.TrainCtx.dump_checkpoint":  # PERSIA's positional names, taken by *args
        names |= set(DUMP_ORDER) | set(DUMP_ORDER_EARLIER)
    if getattr(obj, "__module__", "") == "persia.nn_contexts" and arg in NO_EFFECT:
        return WARNED
    if arg not in names:
        return REFUSED
    return WARNED if said_no_effect(owner.rsplit(".", 1)[-1], arg) else SAME


def said_no_effect(where: str, arg: str) -> bool:
    """Whether the compat layer logs ``where(arg=...) has no effect here``."""
    text = "".join((ROOT / "persia" / name).read_text() for name in ("data.py", "nn_contexts.py", "ctx.py"))
    return re.search(rf'no_effect\(\s*"{re.escape(where)}",\s*"{re.escape(arg)}"', text) is not None


def api_mark(name: str) -> Mark:
    from persia.nn_contexts import REFUSED_METHODS

    m = re.fullmatch(r"(?P<path>[\w.]+?)(?:\.(?P<method>\w+)\(\)|\((?P<arg>\w+)\))?", name)
    assert m, f"{DOC.name}: {name!r} is not a dotted name, X.m() or X(arg)"
    if m["arg"]:
        return argument_mark(m["path"], m["arg"])
    if m["method"]:
        if m["method"] in REFUSED_METHODS:
            return REFUSED
        return SAME if hasattr(resolve(m["path"]), m["method"]) else REFUSED
    try:
        obj = resolve(m["path"])
    except AttributeError as exc:  # refused on look-up, saying what to use instead
        return Mark("missing") if "has no attribute" in str(exc) else REFUSED
    if refuses_when_called(obj):
        return REFUSED
    mark = rows("## Python API")[name]
    if mark.kind == "mapped" and resolve(mark.to) is obj:
        return mark
    return SAME


def test_every_persia_api_name_has_its_mark() -> None:
    import persia.ctx
    import persia.prelude
    from persia.nn_contexts import NO_EFFECT, REFUSED_METHODS

    table = rows("## Python API")
    wanted = {f"persia.ctx.{name}" for name in persia.ctx.persia_names()}
    wanted |= {f"persia.ctx.EmbeddingCtx.{name}()" for name in REFUSED_METHODS}
    wanted |= {f"persia.ctx.TrainCtx({name})" for name in PERSIA_TRAIN_CTX_ARGS}
    wanted |= {f"persia.prelude.{name}" for name in persia.prelude.INSTEAD}
    missing = sorted(wanted - set(table))
    assert not missing, f"{DOC.name}: PERSIA API names without a row: {missing}"
    arguments = {m.group(1) for name in table if (m := re.fullmatch(r"persia\.ctx\.[\w.]+\((\w+)\)", name))}
    unlisted = sorted(set(NO_EFFECT) - arguments)
    assert not unlisted, f"{DOC.name}: NO_EFFECT arguments without a row: {unlisted}"
    wrong = wrong_marks(table, api_mark)
    assert not wrong, f"{DOC.name}: " + "; ".join(wrong)


# ----- behaviours --------------------------------------------------------------------------------------


def _refuses(check: typing.Callable[[], object]) -> bool:
    try:
        check()
    except ConfigError:
        return True
    return False


def behaviour_marks() -> dict[str, Mark]:
    from persia.stay import cat_follows

    named = global_config_from_dict({"common_config": {"job_name": "ctr"}}).common_config.metrics_config.job_name
    return {
        "data_loader: python3 data_loader.py && cat":
            SAME if cat_follows(["/bin/sh", "-c", "python3 data_loader.py && cat "]) else REFUSED,
        "job_type: Infer": WARNED if "job_type" in CommonConfig._unused_keys else SAME,
        "persia_default_jobname": Mark("mapped", "common_config.job_name") if named == "ctr" else SAME,
        "metrics push": WARNED if "push_interval_seconds" in MetricsConfig._unused_keys else SAME,
        "unknown config keys": REFUSED if _refuses(lambda: global_config_from_dict({"jobname": "x"})) else SAME,
        "hdfs://": REFUSED if _refuses(lambda: check_root("hdfs://namenode/ckpt", "checkpoint_dir")) else SAME,
        # facts of docs/checkpoints.md and deploy/, which no code answers
        "checkpoint layout": REFUSED,
        "resharding": SAME,
        "PersiaJob": REFUSED,
    }


def test_every_behaviour_has_its_mark() -> None:
    table, truth = rows("## Behaviours"), behaviour_marks()
    assert sorted(table) == sorted(truth), f"{DOC.name}, Behaviours: rows {sorted(table)}, checked {sorted(truth)}"
    wrong = wrong_marks(table, truth.__getitem__)
    assert not wrong, f"{DOC.name}: " + "; ".join(wrong)


# ----- the figures, and the links to the page ------------------------------------------------------------


def figures() -> dict[str, tuple[int, int, int]]:
    """Figures row -> (rows, rows that work unchanged, rows refused), counted from the tables."""
    out = {}
    for label, heading in SECTIONS.items():
        marks = list(rows(heading).values())
        refused = sum(m.kind == "refused" for m in marks)
        out[label] = (len(marks), len(marks) - refused, refused)
    out["all"] = tuple(sum(v[i] for v in out.values()) for i in range(3))  # type: ignore[assignment]
    return out


def test_the_figures_are_the_tables_counts() -> None:
    stated = {}
    for line in section("## In figures").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and all(c.isdigit() for c in cells[1:]):
            stated[cells[0]] = tuple(int(c) for c in cells[1:])
    assert stated == figures(), f"{DOC.name}, In figures: the page says {stated}, the tables count {figures()}"


@pytest.mark.parametrize("page", ["README.md", "docs/configuration.md"])
def test_the_page_is_linked(page: str) -> None:
    target = "migrating-from-persia.md" if page.startswith("docs/") else "docs/migrating-from-persia.md"
    assert f"]({target})" in (ROOT / page).read_text(), f"{page} does not link {target}"
