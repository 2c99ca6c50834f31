"""The internals of persia-nats, in one tower of layers, each importing only from itself and those
below it (``tests/unit/test_layers.py`` checks every import):

1. base: the NATS-free half of ``persia_nats.common`` (the codec, messages, configs, env, subjects,
   errors, checkpoint files and storage, logging and process settings) and this package;
2. ``persia_nats.core``: the maths with no NATS and no torch (the PS table, optimizers, batch plans and
   pooling, float16 packing, sharding, stacked rows);
3. the NATS half of ``persia_nats.common``: rpc, service, discovery, metrics, health, acks and the
   roles' shared entry-point plumbing (``launch``);
4. ``persia_nats.dense``: the torch side the NN worker and serving share;
5. ``persia_nats.services``: one package per role, its entry point and composition root in its
   ``main``, never importing another role;
6. :mod:`persia`, the user API and ``persia-launcher``, above them all: nothing here imports it.

The folders live at the top of the repository as ``core/``, ``common/``, ``dense/`` and
``services/``; the distribution installs them here, under one name of ours, so that they neither
clash with nor overwrite other distributions' ``common`` and ``services``."""

from __future__ import annotations

from pathlib import Path

#: the files installed with the package (a copy of deploy/*.conf and of the documented configs)
DATA = Path(__file__).resolve().parent / "data"


def data_file(name: str) -> Path:
    """The installed copy of a shipped file: ``nats.conf``, ``nats-jetstream.conf``, ``nats-auth.conf``,
    ``nats-secure.conf``, or ``configs/<name>.yml`` (``global_config.yml`` and ``embedding_config.yml``
    with every key documented; ``adult_global_config.yml`` and ``adult_embedding_config.yml`` of the
    adult-income example).

    Raises:
        FileNotFoundError: no such file ships with the package (the message lists what does).
    """
    path = DATA / name
    if not path.is_file() or DATA not in path.resolve().parents:
        shipped = sorted(str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file())
        raise FileNotFoundError(f"{name!r} is not a file shipped with persia-nats; shipped: {', '.join(shipped)}")
    return path
