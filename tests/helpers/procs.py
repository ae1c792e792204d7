"""Process state read from ``/proc`` (Linux), for tests that kill processes or look for a server's children."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first, then the parent pid), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Running (a zombie, killed but not yet reaped by its parent, counts as gone)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def spawned_children(parent: int) -> list[int]:
    """``parent``'s children started by multiprocessing's spawn (its resource tracker is not one of them)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        try:
            cmd = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields is not None and int(fields[1]) == parent and b"spawn_main" in cmd:
            pids.append(int(entry.name))
    return pids
