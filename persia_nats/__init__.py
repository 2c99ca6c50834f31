"""The internals of persia-nats: ``persia_nats.common`` (the codec, configs, subjects and service
plumbing every role shares) and ``persia_nats.services`` (one package per role).

The folders live at the top of the repository as ``common/`` and ``services/``; the distribution
installs them here, under one name of ours, so that they neither clash with nor overwrite other
distributions' ``common`` and ``services``. The user API is :mod:`persia`.
"""
