"""The install instructions a new user follows: README's first lines work from a clone, compile once, name the
CPU-only torch, and the demo's set-up prints no pip error on its normal path."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _install_section(path: Path, heading: str) -> str:
    text = path.read_text(encoding="utf-8")
    start = text.index(heading)
    return text[start:text.index("\n## ", start + 1)]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)


def test_the_readme_installs_from_a_clone_with_one_compile() -> None:
    """The first block needs no dist/ (a clone has none), says which torch, and builds the kernels once: every
    `--no-build-isolation` install in the README compiles them, so there is one such command."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = _bash_blocks(_install_section(REPO / "README.md", "## Install"))[0]
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.split("#")[0].strip()]
    assert commands[0] == f"pip install torch --index-url {CPU_INDEX}"
    assert "pip install --no-build-isolation ." in commands
    assert "dist/" not in first
    compiles = [line for block in _bash_blocks(readme) for line in block.splitlines()
                if re.match(r"pip install [^#]*--no-build-isolation", line)]
    assert len(compiles) == 1, compiles
    assert readme.index(first) < readme.index("pip install dist/drmoo-")  # the wheel route comes second


def test_the_install_page_names_the_cpu_and_the_cuda_torch() -> None:
    page = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    assert f"pip install torch --index-url {CPU_INDEX}" in page
    assert "pip install torch\n" in page or "`pip install torch`" in page


def test_the_demo_setup_probe_for_the_cpu_torch_prints_no_pip_error(tmp_path: Path) -> None:
    """Where PyTorch's CPU index cannot be reached, the set-up says so in one line of its own; pip's
    ResolutionImpossible goes to a log (shown with DRMOO_SETUP_VERBOSE=1)."""
    setup_env = (REPO / "scripts" / "setup_env.sh").read_text(encoding="utf-8")
    probe = re.search(r"^ *probe_log=\$\(mktemp\)\n.*?^ *rm -f \"\$probe_log\"\n", setup_env, re.M | re.S)
    assert probe is not None, "scripts/setup_env.sh: the CPU-only torch probe is not where this test looks"
    script = tmp_path / "probe.sh"
    script.write_text(f'set -euo pipefail\nvenv="$1"\ncpu_index=file:///nonexistent\ntorch_pin=2.14.1\n'
                      f"vision_pin=0.29.1\n{probe.group(0)}echo done\n")
    # pip given no index at all: the install fails at once, as an unreachable index makes it fail
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    venv = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv"))
    quiet = subprocess.run(["bash", str(script), str(venv)], capture_output=True, text=True, env=env, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert quiet.stdout.splitlines() == [
        "[setup] torch 2.14.1+cpu is not available from file:///nonexistent here: installing PyPI's build "
        "(with its CUDA libraries) instead", "done"]
    verbose = subprocess.run(["bash", str(script), str(venv)], capture_output=True, text=True, timeout=60,
                             env={**env, "DRMOO_SETUP_VERBOSE": "1"})
    assert "[setup]   pip: ERROR" in verbose.stdout
