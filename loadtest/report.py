"""Where every benchmark's results go: `<stem>.json` (the figures) beside `<stem>.md` (the
table people read), both written by the command that measured them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def publish(out: Path, stem: str, data: Any, text: str, echo: bool = True) -> None:
    """Write `data` as JSON and `text` as markdown under `out`; print the markdown too."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{stem}.md").write_text(text if text.endswith("\n") else text + "\n")
    if echo:
        print(text)
