"""Run the kernel benchmarks and write bench/results/<machine>.json (pytest-benchmark) and .md.

Usage (from anywhere; extra arguments go to pytest, e.g. ``-k gram_step``)::

    python bench/run.py
    python bench/run.py --summary-only bench/results/<machine>.json   # redo the table from a JSON

Benchmarks are timed only with ``--benchmark-only`` or ``--benchmark-enable`` (the repository's
conftest.py disables them otherwise); this runner passes both and points pytest at bench/ (its
testpaths name tests/ only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Run from the source tree even when drmoo is not installed.
    paths = [str(ROOT / "python"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # The Triton interpreter is a correctness path; it must not leak into timings.
    env.pop("TRITON_INTERPRET", None)
    return env


def _machine(env: dict[str, str]) -> tuple[str, str]:
    code = (
        "import sys; sys.path.insert(0, 'bench'); import conftest as c; "
        "print(c.machine_slug()); print(c.machine_description())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    slug, description = out.stdout.strip().splitlines()[-2:]
    return slug, description


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def summarize(json_path: Path) -> str:
    """A markdown table of every record: median, GB/s, speedup vs reference, fraction of copy bandwidth."""
    data = json.loads(json_path.read_text())
    records = data["benchmarks"]
    machine = records[0]["extra_info"].get("machine", "?") if records else "?"
    lines = [
        f"# drmoo kernel benchmarks: {machine}",
        "",
        f"pytest-benchmark JSON: `{json_path.name}`, {data.get('datetime', '')}.  "
        "Times are the minimum over the rounds (the machine may be shared; medians are in the JSON). "
        "speedup = reference time / backend time (same run); copy fraction = achieved GB/s / GB/s of a "
        "same-run torch `copy_` moving the same bytes.  float32, chi2 for the dual ops.",
        "",
    ]
    # On a GPU every record with bytes also carries its fraction of the device's peak bandwidth.
    peak = next((r["extra_info"]["device_peak_gb_per_s"] for r in records
                 if "device_peak_gb_per_s" in r["extra_info"]), None)
    if peak is not None:
        lines += [f"Device peak memory bandwidth (clock x bus width): {peak:.0f} GB/s.", ""]
    lines += [
        "| op | shape | backend | min | median | GB/s | speedup vs reference | copy fraction |"
        + (" peak fraction |" if peak is not None else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if peak is not None else ""),
    ]
    if any("device_median_s" in r["extra_info"] for r in records):
        return "\n".join(lines[:2] + _device_table(records, peak)) + "\n"
    for record in records:
        info = record["extra_info"]
        shape = " ".join(f"{k}={info[k]}" for k in ("B", "m", "n") if k in info)
        extra = f" (step/floor {info['step_over_floor']:.2f})" if "step_over_floor" in info else ""
        if "speedup_vs_foreach_norm" in info:  # sum_squares: also against the guard it replaced
            extra += f" (vs _foreach_norm {info['speedup_vs_foreach_norm']:.2f})"
        lines.append(
            f"| {info['op']} | {shape} | {info['backend']} | {_fmt_time(record['stats']['min'])} | "
            f"{_fmt_time(record['stats']['median'])} | "
            f"{_fmt(info.get('gb_per_s') or None, '.2f')} | {_fmt(info.get('speedup_vs_reference'), '.2f')}{extra} | "
            f"{_fmt(info.get('fraction_of_copy_bandwidth'), '.2f')} |"
            + (f" {_fmt(info.get('fraction_of_device_bandwidth'), '.2f')} |" if peak is not None else "")
        )
    return "\n".join(lines) + "\n"


def _device_table(records: list[dict[str, Any]], peak: float | None) -> list[str]:
    """The GPU table: every figure from the op's device time (CUDA events), one number per shape."""
    first = next(r["extra_info"] for r in records if "device_median_s" in r["extra_info"])
    lines = [
        f"Device time: the median of {first.get('event_rounds', '?')} calls issued back to back after a warm-up, "
        "each bracketed by CUDA events (bench/conftest.py's `events_median_s`, the same measure as "
        "scripts/gpu_bandwidth.py's `events` column).  GB/s, the fractions and the speedup over the reference all "
        "come from it; copy fraction = achieved GB/s / GB/s of a same-run torch `copy_` timed the same way.  "
        "`host` is the host-clock median of one call followed by `torch.cuda.synchronize()` (launch latency "
        "included).  float32, chi2 for the dual ops.",
        "",
    ]
    if peak is not None:
        lines += [f"Device peak memory bandwidth (clock x bus width): {peak:.0f} GB/s.", ""]
    lines += ["| op | shape | backend | device time | GB/s | peak fraction | copy fraction | speedup vs reference "
              "| host |", "|---|---|---|---|---|---|---|---|---|"]
    for record in records:
        info = record["extra_info"]
        shape = " ".join(f"{k}={info[k]}" for k in ("B", "m", "n") if k in info)
        seconds = info.get("device_median_s")
        extra = f" (step/floor {info['step_over_floor']:.2f})" if "step_over_floor" in info else ""
        lines.append(
            f"| {info['op']} | {shape} | {info['backend']} | "
            f"{'-' if seconds is None else _fmt_time(seconds)} | {_fmt(info.get('gb_per_s_device'), '.2f')} | "
            f"{_fmt(info.get('fraction_of_device_bandwidth_device'), '.2f')} | "
            f"{_fmt(info.get('fraction_of_copy_bandwidth_device'), '.2f')} | "
            f"{_fmt(info.get('speedup_vs_reference_device'), '.2f')}{extra} | {_fmt_time(record['stats']['median'])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary-only", type=Path, help="only rebuild the markdown table of this JSON")
    args, pytest_args = parser.parse_known_args(argv)
    if args.summary_only is not None:
        md = args.summary_only.with_suffix(".md")
        md.write_text(summarize(args.summary_only))
        print(f"wrote {md}")
        return 0
    env = _env()
    slug, description = _machine(env)
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / f"{slug}.json"
    print(f"benchmarking on {description} -> {json_path}")
    command = [
        sys.executable, "-m", "pytest", str(BENCH), "-p", "no:cacheprovider", "-q",
        "--benchmark-enable", "--benchmark-only", f"--benchmark-json={json_path}",
        "--benchmark-columns=median,iqr,rounds", "--benchmark-sort=name", *pytest_args,
    ]
    status = subprocess.run(command, cwd=ROOT, env=env).returncode
    if json_path.exists():
        md = json_path.with_suffix(".md")
        md.write_text(summarize(json_path))
        print(f"wrote {json_path} and {md}")
    return status


if __name__ == "__main__":
    sys.exit(main())
