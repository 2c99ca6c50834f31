"""The internals of persia-nats, in layers: ``persia_nats.core`` (the maths with no NATS and no torch:
the PS table, optimizers, batch plans and pooling, float16 packing, sharding),
``persia_nats.common`` (the codec, configs, subjects, discovery and service plumbing every role
shares), ``persia_nats.dense`` (the torch side the NN worker and serving share) and
``persia_nats.services`` (one package per role; a role imports ``core``, ``common`` and, where the
dense model lives, ``dense``, never another role).

The folders live at the top of the repository as ``core/``, ``common/``, ``dense/`` and
``services/``; the distribution installs them here, under one name of ours, so that they neither
clash with nor overwrite other distributions' ``common`` and ``services``. The user API is
:mod:`persia`.
"""

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
