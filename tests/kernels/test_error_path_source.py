"""The compiled ops' error paths never format through c10::str or an ostringstream (see csrc/checks.h).

On the torch 2.11.0+cu130 GPU image, every TORCH_CHECK whose message had a number or a std::string
in it (formatted by c10::str's std::ostringstream inside the extension) killed the interpreter,
while single-C-string messages raised.  csrc/ therefore calls DRMOO_CHECK, which assembles the
message itself (std::string, std::to_string, snprintf) and throws it; this test keeps a torch check
macro -- TORCH_CHECK* of the regular API, STD_TORCH_CHECK of the stable one, which streams its
message arguments the same way -- from coming back.
"""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# A torch check macro called with a condition and at least one message argument.
TORCH_CHECK_CALL = re.compile(r"\b(?:STD_)?TORCH_CHECK(?:_VALUE|_TYPE|_INDEX|_WITH|_MSG)?\s*\(")


def _torch_check_calls(text: str) -> list[str]:
    calls = []
    for match in TORCH_CHECK_CALL.finditer(text):
        line = text[text.rfind("\n", 0, match.start()) + 1 : text.find("\n", match.start())]
        if line.lstrip().startswith(("#define", "//")):
            continue
        calls.append(line.strip())
    return calls


def test_sources_exist() -> None:
    sources = list(CSRC.rglob("*.h")) + list(CSRC.rglob("*.cpp")) + list(CSRC.rglob("*.cu*"))
    assert len(sources) >= 6


def test_no_torch_check_formats_its_own_message() -> None:
    offenders = {
        str(path.relative_to(CSRC)): calls
        for path in sorted(CSRC.rglob("*"))
        if path.suffix in {".h", ".cpp", ".cu", ".cuh", ".inc"}
        and (calls := _torch_check_calls(path.read_text()))
    }
    assert offenders == {}, f"use DRMOO_CHECK (csrc/checks.h) instead: {offenders}"


def test_the_detector_finds_a_plain_torch_check() -> None:
    planted = 'void f(int m) {\n  TORCH_CHECK_VALUE(m > 0, "m must be > 0, got ", m);\n}\n'
    assert _torch_check_calls(planted) == ['TORCH_CHECK_VALUE(m > 0, "m must be > 0, got ", m);']
    stable = 'void f(int m) {\n  STD_TORCH_CHECK(m > 0, "m must be > 0, got ", m);\n}\n'
    assert _torch_check_calls(stable) == ['STD_TORCH_CHECK(m > 0, "m must be > 0, got ", m);']
