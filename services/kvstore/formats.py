"""One shape per KV format: the first writer registers it in the backend, so every replica agrees.

A KV format key already names the model, KV dtype and block size, so two shapes under one key mean
a caller computed the key wrongly; its Put is refused rather than mixing blocks readers cannot use.
Shapes are cached here once known (a format's shape never changes while it is registered).
"""

from __future__ import annotations

from collections import OrderedDict

import structlog

from services.kvstore.backend import BackendUnavailable, format_key
from services.kvstore.block_format import BlockShape
from services.kvstore.health import MonitoredBackend
from services.kvstore.settings import MAX_CACHED_FORMATS
from services.kvstore.validation import invalid

log = structlog.get_logger()


class FormatRegistry:
    """Registered shapes by kv_format, backed by the backend's format keys."""

    def __init__(self, store: MonitoredBackend) -> None:
        self._store = store
        self._shapes: OrderedDict[str, BlockShape] = OrderedDict()

    def shape_of(self, kv_format: str) -> BlockShape | None:
        """The shape known here for kv_format, if any (no I/O)."""
        return self._shapes.get(kv_format)

    async def check(self, kv_format: str, shape: BlockShape, field: str = "header.shape") -> bool:
        """True if shape is kv_format's (registering it if none is); False if the backend cannot say.

        Raises StatusError (INVALID_ARGUMENT) if another shape is registered.
        """
        registered = self._shapes.get(kv_format)
        if registered is None:
            try:
                registered = await self._register(kv_format, shape)
            except BackendUnavailable:
                return False
            if registered is None:
                return False
            self._shapes[kv_format] = registered
            if len(self._shapes) > MAX_CACHED_FORMATS:
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(kv_format)
        if registered != shape:
            raise invalid(
                field,
                f"{shape} differs from the shape registered for this kv_format, {registered}: one kv_format has "
                "one shape (check the kv_format key the worker computed from its model, KV dtype and block size)",
            )
        return True

    async def _register(self, kv_format: str, shape: BlockShape) -> BlockShape | None:
        key = format_key(kv_format)
        for _ in range(2):
            record = await self._store.register_format(key, shape.to_json())
            try:
                return BlockShape.from_json(record)
            except ValueError as err:
                # Not written by this store (or damaged): replace it with ours, once.
                log.warning("replacing a bad format record", key=key, error=str(err))
                await self._store.delete([key])
        return None
