"""Reading kvtier's Redis Lua scripts.

Every script lives in its own `.lua` file beside the module that runs it (consumers/ or
router/), never as a string inside Python: it reads and diffs as Lua, and its header says
what KEYS and ARGV it takes. pyproject.toml's package-data ships `*.lua` with those packages;
`load_lua` is the one way the code reads them.
"""

from __future__ import annotations

import importlib.resources


def load_lua(package: str, name: str) -> str:
    """The source of script `name` in `package`'s folder, e.g. `load_lua("kvtier.router", "release.lua")`."""
    return importlib.resources.files(package).joinpath(name).read_text()
