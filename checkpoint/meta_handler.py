"""The Orbax handler of the `meta` item: the same JSON file as Orbax's JsonCheckpointHandler (read it with
`ocp.args.JsonRestore` or `json.load`), except that the array checksums, still being computed on the
devices when save() returns, are fetched and filled in by the background commit: the training loop
never waits for them, and the meta still lands atomically with the state."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp

from checkpoint import integrity


@dataclasses.dataclass
class DeferredMeta:
    """A meta dict whose `arrays[*]['checksum']` come from `sums` (uint32[n, 2] on the devices)."""
    meta: dict[str, Any]
    names: list[str]
    sums: jax.Array | None

    def resolve(self) -> dict[str, Any]:
        for name, value in integrity.to_hex(self.names, self.sums).items():
            self.meta["arrays"][name]["checksum"] = value
        return self.meta


class MetaHandler(ocp.handlers.JsonCheckpointHandler):
    async def _save_fn(self, x, directory):
        if isinstance(x, DeferredMeta):
            x = await asyncio.to_thread(x.resolve)  # the wait for the devices stays off the event loop
        await super()._save_fn(x, directory)


@ocp.args.register_with_handler(MetaHandler, for_save=True)
@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
    item: DeferredMeta | dict[str, Any]


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
@dataclasses.dataclass
class MetaRestore(ocp.args.CheckpointArgs):
    item: Any = None
