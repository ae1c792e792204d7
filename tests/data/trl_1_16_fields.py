"""Regenerate ``trl_1_16_async_grpo_config.json``: the dataclass fields of TRL 1.16's async GRPO config.

The fields are read from the wheel's source with ``ast`` (nothing of TRL is imported or copied: names, annotations
and default values only), so the test's list is TRL's, not one typed from memory:

    pip download --no-deps trl==1.16.0 -d /tmp/trl116
    python tests/data/trl_1_16_fields.py /tmp/trl116/trl-1.16.0-py3-none-any.whl > tests/data/trl_1_16_async_grpo_config.json
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

CONFIG = "trl/experimental/async_grpo/async_grpo_config.py"  # class AsyncGRPOConfig(_BaseConfig)
BASE = "trl/trainer/base_config.py"  # class _BaseConfig(TrainingArguments): defaults TRL changes for every trainer
TRAINER = "trl/experimental/async_grpo/async_grpo_trainer.py"  # AsyncGRPOTrainer and the two plug-in protocols


def dataclass_fields(source: str, class_name: str) -> list[dict[str, Any]]:
    """``name``, ``annotation`` and ``default`` of each ``name: T = field(default=...)`` in ``class_name``."""
    cls = _class(source, class_name)
    out = []
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
            kwargs = {k.arg: k.value for k in value.keywords}
            if "default" not in kwargs:
                raise SystemExit(f"{class_name}.{stmt.target.id} has no literal default; extend this script")
            value = kwargs["default"]
        out.append({"name": stmt.target.id, "annotation": ast.unparse(stmt.annotation),
                    "default": ast.literal_eval(value)})  # fmt: skip
    return out


def _class(source: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name)


def methods(source: str, class_name: str) -> list[str]:
    """The public methods a ``Protocol`` class declares, in order."""
    return [f.name for f in _class(source, class_name).body if isinstance(f, ast.FunctionDef)]


def init_parameters(source: str, class_name: str) -> list[str]:
    """``__init__``'s parameter names after ``self``, in order."""
    init = next(f for f in _class(source, class_name).body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    return [a.arg for a in init.args.args[1:]]


def main(wheel: str) -> dict[str, Any]:
    data = Path(wheel).read_bytes()
    with zipfile.ZipFile(wheel) as zf:
        config = dataclass_fields(zf.read(CONFIG).decode(), "AsyncGRPOConfig")
        base = dataclass_fields(zf.read(BASE).decode(), "_BaseConfig")
        trainer = zf.read(TRAINER).decode()
    return {
        "wheel": Path(wheel).name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "source": CONFIG,
        "fields": config,
        "base_source": BASE,
        "base_fields": base,
        "trainer_source": TRAINER,
        "trainer_init": init_parameters(trainer, "AsyncGRPOTrainer"),
        "rollout_worker_protocol": methods(trainer, "RolloutWorkerProtocol"),
        "weight_transfer_protocol": methods(trainer, "WeightTransferProtocol"),
    }


if __name__ == "__main__":
    json.dump(main(sys.argv[1]), sys.stdout, indent=1)
    sys.stdout.write("\n")
