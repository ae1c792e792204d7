"""File permissions of what the library writes: saved models must be readable by whoever serves or copies them."""

from __future__ import annotations

import os


def make_readable(directory: str | os.PathLike) -> None:
    """Give the files under ``directory`` the read permissions the process's umask allows.

    transformers writes ``model.safetensors`` through a private temporary file (mode 0600), so a model saved for
    a server started by another user, or copied to a shared folder, could not be read there.
    """
    umask = os.umask(0)
    os.umask(umask)  # reading the umask means setting it; set it back at once
    readable = 0o444 & ~umask
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            mode = os.stat(path).st_mode & 0o777
            if mode & readable != readable:
                os.chmod(path, mode | readable)
