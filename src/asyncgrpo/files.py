"""File permissions of what the library writes: saved models must be readable by whoever serves or copies them."""

from __future__ import annotations

import os


def local_only(name_or_path: str | os.PathLike) -> dict[str, bool]:
    """``local_files_only=True`` for a local directory, for transformers' ``from_pretrained``.

    Without it, transformers 5.x still asks the Hub about a local tokenizer (whether it derives from a Mistral
    model): on a machine without network that waits out the Hub's 10 s timeout on every load (measured on an H200
    box: the server's tokenizer phase took 10.0 s; 0.2 s with the flag)."""
    return {"local_files_only": True} if os.path.isdir(name_or_path) else {}


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
