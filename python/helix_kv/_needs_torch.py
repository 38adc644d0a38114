"""The torch check of the subpackages that need it (``helix_kv.executor``,
``helix_kv.distributed``): without torch their import says which extra to install."""

from __future__ import annotations

#: How to install torch for helix_kv: its ``torch`` extra.
TORCH_EXTRA = "pip install 'helix_kv[torch]'"


def require_torch(package: str) -> None:
    """Raise ``ModuleNotFoundError`` (an ``ImportError``, ``name="torch"``) naming ``package``
    and the extra to install when torch is not installed; a torch that is installed but fails
    to import raises its own error unchanged."""
    try:
        import torch  # noqa: F401  (imported to check that it imports)
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        raise ModuleNotFoundError(
            f"{package} needs torch, which is not installed; install it with: {TORCH_EXTRA}",
            name="torch",
        ) from None
