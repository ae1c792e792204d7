"""Check a round's names and shapes against the server's model before anything is broadcast.

vLLM's NCCL worker checks only that ``update_info``'s three lists have one length: an unknown name or a wrong
shape fails inside ``model.load_weights``, during the broadcast, where the trainer sees a collective that never
completes (docs/protocol.md). No vLLM route lists the model's parameters, but ``/server_info`` names the
checkpoint it loaded (``vllm_config.model_config.model``), and ``load_weights`` takes the checkpoint's own
tensor names. So the sender reads that checkpoint's safetensors headers (names and shapes, a few KB; no tensor
is loaded) when the path is readable here, and refuses a round that sends what the server cannot load.

The check is skipped, with one log line saying why, when the checkpoint is not readable from the trainer (a
server on another machine, a hub id not in the local cache) or when most of the trainer's names are missing from
it (a checkpoint in an older layout that transformers renames at load time, as vLLM's loaders do too).
"""

from __future__ import annotations

import functools
import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.errors import ServerError
from asyncgrpo.vllm_traits import config_section
from asyncgrpo.weights.base import ServerControl
from asyncgrpo.weights.collectives import TensorMeta

logger = logging.getLogger(__name__)

# Below this fraction of the trainer's names found in the checkpoint, the naming scheme differs (a layout that is
# renamed at load time): the check cannot tell a wrong name from a renamed one, so it stands aside.
MIN_MATCHING_FRACTION = 0.5
MAX_LISTED = 5  # problems named in the error; the count says how many more
_HEADER_LIMIT_BYTES = 100 * 1024 * 1024  # a safetensors header larger than this is not a header


@dataclass(frozen=True)
class ServerWeights:
    """What the server's model loads: HF tensor name -> shape, read from ``source`` (its checkpoint)."""

    shapes: dict[str, tuple[int, ...]]
    source: str

    @functools.cached_property
    def split_modules(self) -> set[str]:
        """Modules whose tensors the checkpoint stores one per index (``experts.0.gate_proj.weight``...): read
        once per sender, not once per round.

        transformers 5 loads such a list into one fused parameter (``experts.gate_up_proj``) and writes it back
        split, so a trainer's fused name is absent from the checkpoint without being wrong.
        """
        out = set()
        for name in self.shapes:
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts)) if parts[i].isdigit())
        return out


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one ``.safetensors`` file, from its JSON header only (8-byte length, then JSON)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > _HEADER_LIMIT_BYTES:
            raise ValueError(f"{path} does not start with a safetensors header ({length} bytes announced)")
        header = json.loads(fh.read(length))
    return {name: tuple(int(d) for d in entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def _local_checkpoint(model: str) -> Path | None:
    """The directory of ``model`` on this machine: a path, or a hub id already in the local hub cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or model.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
    except Exception as exc:  # noqa: BLE001 - not cached here (or no hub library): the check is skipped
        logger.debug("hub id %s is not in the local cache: %s", model, exc)
        return None


def checkpoint_weights(model: str) -> ServerWeights | None:
    """The tensors of the checkpoint ``model`` names (every ``*.safetensors`` of its directory), or None."""
    directory = _local_checkpoint(model)
    if directory is None:
        return None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(safetensors_shapes(f))
    return ServerWeights(shapes, f"{directory} ({len(files)} safetensors file(s))")


async def server_weights(client: ServerControl) -> ServerWeights | None:
    """The server's model as its checkpoint describes it, or None (logged) when it cannot be read from here."""
    try:
        info = await client.server_info()
    except ServerError as exc:
        logger.info("no /server_info from %s (%s): weight names are not checked before broadcasting",
                    client.base_url, exc)  # fmt: skip
        return None
    model = config_section(info, "vllm_config", "model_config").get("model")
    weights = checkpoint_weights(model) if isinstance(model, str) and model else None
    if weights is None:
        logger.info("the checkpoint %r that %s serves is not readable on this machine: weight names and shapes are "
                    "not checked before broadcasting", model, client.base_url)  # fmt: skip
    return weights


def check_round(metas: Sequence[TensorMeta], server: ServerWeights | None, url: str) -> None:
    """Refuse a round whose names or shapes the server's model would not load (before any pause or broadcast).

    Raises:
        ValueError: names the server's checkpoint lacks, or shapes that differ, with the fix.
    """
    if server is None or not metas:
        return
    unknown = [m.name for m in metas if m.name not in server.shapes]
    fused = {n for n in unknown if n.rpartition(".")[0] in server.split_modules}
    if fused:
        logger.info(
            "%d weight names (e.g. %s) are stored split per index in %s and fused when loaded (transformers "
            "5's MoE experts): their names and shapes are not checked",
            len(fused),
            min(fused),
            server.source,
        )
        unknown = [n for n in unknown if n not in fused]
    if len(unknown) > (1 - MIN_MATCHING_FRACTION) * len(metas):
        logger.warning("%d of the %d weight names the trainer sends are not in %s (e.g. %s): its layout differs "
                       "from the trainer's, so names and shapes are not checked before broadcasting",
                       len(unknown), len(metas), server.source, unknown[:2])  # fmt: skip
        return
    wrong = [f"{m.name}: trainer {list(m.shape)}, server {list(server.shapes[m.name])}"
             for m in metas if m.name in server.shapes and tuple(m.shape) != server.shapes[m.name]]  # fmt: skip
    if not unknown and not wrong:
        return
    lines = [*(f"unknown to the server: {n}" for n in unknown[:MAX_LISTED]), *wrong[:MAX_LISTED]]
    more = len(unknown) + len(wrong) - len(lines)
    raise ValueError(
        f"the weights the trainer would send do not fit the model of {url} (read from {server.source}):\n  - "
        + "\n  - ".join(lines)
        + (f"\n  - ... and {more} more" if more > 0 else "")
        + "\nvLLM would fail inside the broadcast on these. Serve the checkpoint the trainer starts from (same "
        "architecture and sizes); if the server does load these names under another layout, "
        "WeightSender(check_names=False) turns this check off"
    )
