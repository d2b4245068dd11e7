"""Names that moved, kept one release under their old home with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(module: str, moved: dict[str, str]):
    """A module ``__getattr__`` resolving each old name in ``moved`` to its new home, with a
    DeprecationWarning naming it: ``{old: "new.module:new_name"}`` for a name in a module,
    ``{old: "new.module"}`` for a module that moved."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, _, new = moved[name].partition(":")
        warnings.warn(
            f"{module}.{name} moved to {where}{'.' + new if new else ''}; the old name is removed in the next release",
            DeprecationWarning, stacklevel=2,
        )  # fmt: skip
        target = importlib.import_module(where)
        return getattr(target, new) if new else target

    return __getattr__


def moved_module(old: str, new: str) -> None:
    """Make module ``old`` (an alias file, run on its import) the module ``new``, with a
    DeprecationWarning naming it: ``import old`` then gives ``new`` itself."""
    target = importlib.import_module(new)
    warnings.warn(f"{old} moved to {new}; the old name is removed in the next release", DeprecationWarning, stacklevel=3)
    sys.modules[old] = target
