"""Write deploy/serve.lock, the runtime image's pins: the serving install ('.[milvus]')
resolved by pip against this venv's versions, the ones `make test` passed with (`make lock`)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

LOCK = Path(__file__).with_name("serve.lock")
HEADER = ("# The image's pins: the serving install ('.[milvus]') resolved against the versions\n"
          "# the tests passed with. Regenerate with `make lock` after a dependency change.\n")


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        freeze, report = Path(scratch) / "freeze.txt", Path(scratch) / "report.json"
        freeze.write_text(subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
            capture_output=True, text=True).stdout)
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                        "--ignore-installed", "--report", str(report), "-c", str(freeze),
                        ".[milvus]"], check=True)
        installs = json.loads(report.read_text())["install"]
    pins = sorted((f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installs
                   if i["metadata"]["name"].lower() != "r4t"), key=str.lower)
    LOCK.write_text(HEADER + "".join(f"{pin}\n" for pin in pins))
    print(f"wrote {LOCK}: {len(pins)} pins")


if __name__ == "__main__":
    main()
