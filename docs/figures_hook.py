"""mkdocs hook: figures of the committed results join the site, so that a page can show one.

The figures live beside the runs that made them (``results/...``, outside ``docs/``, where the scripts write
them and the results READMEs name them); each one listed in :data:`FIGURES` is served at
``results/figures/<name>``.  A listed figure that is missing fails the build instead of leaving a broken
image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

# The site's name of each figure -> where the results keep it (relative to the repository root).
FIGURES = {
    "multimnist2-dr-path-tuned.png": "results/multimnist2-small/dr-path-tuned/lambda-path.png",
    "mnist-attributes-dr-path-unweighted-tuned.png":
        "results/mnist-attributes-small/dr-path/unweighted-tuned/lambda-path.png",
}


def on_files(files: Files, config: Any, **_: Any) -> Files:
    root = Path(config["config_file_path"]).parent
    for name, source in FIGURES.items():
        path = root / source
        if not path.is_file():
            raise PluginError(f"{source}: the figure docs/figures_hook.py serves as results/figures/{name} is missing")
        files.append(File.generated(config, f"results/figures/{name}", abs_src_path=str(path)))
    return files
