"""Loadouts in the server: the catalog (shipped files plus the loadouts folder), resolved with
`extends` applied. Versioned loadouts saved through the API will live here too."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from agentic_sandbox.broker.instances.errors import InvalidInput, NotFoundError
from agentic_sandbox.provision import Loadout, LoadoutCatalog, LoadoutError, load_catalog


class Loadouts:
    def __init__(self, folder: Path) -> None:
        self.catalog: LoadoutCatalog = load_catalog([folder])

    def names(self) -> list[str]:
        return self.catalog.names()

    def get(self, name: str) -> Loadout:
        """A listed loadout, resolved; an unknown name is `NotFoundError`."""
        if name not in self.catalog.names():
            raise NotFoundError("loadout", name)
        return self.catalog.resolve(name)

    def resolve(self, name: str, inline: Mapping[str, object] | None = None) -> Loadout:
        """The loadout an instance or pool is made with: `inline` (a loadout as its YAML would
        be, resolved against the catalog without joining it) or the named one. A problem is
        `InvalidInput` of `loadout`."""
        try:
            if inline is not None:
                catalog = self.catalog.copy()
                return catalog.resolve(catalog.add(dict(inline), "body.loadout_spec"))
            return self.catalog.resolve(name)
        except (LoadoutError, KeyError) as exc:
            raise InvalidInput("loadout", str(exc)) from None
