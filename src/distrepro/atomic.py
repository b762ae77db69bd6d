"""Files that readers see whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
