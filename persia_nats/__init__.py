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
