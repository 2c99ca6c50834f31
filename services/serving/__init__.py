"""Inference service: predictions over NATS from a training checkpoint, reloaded while it serves.

- :mod:`.model`: the user's model factory (``module:callable`` plus JSON keyword arguments).
- :mod:`.snapshot`: one checkpoint loaded for serving (every PS shard merged into one store, the
  dense model) and :func:`~.snapshot.predict`, the pure request -> predictions path, shared by the
  service and any offline evaluation.
- :mod:`.service`: :class:`~.service.InferenceService` on ``persia.<job>.serve.predict`` and
  ``persia.<job>.serve.info`` (queue group ``serve``), with hot reload of newer checkpoints.
"""
