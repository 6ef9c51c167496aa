"""The one reader of JSON and JSON-lines data files, and the one way a broken one is named.

pandas (the download stage) and datasets' Arrow reader (`finetune validate`, streaming) each
report a broken line in their own terms: a byte offset, a 0-based row, an internal
`ArrowInvalid`. Whichever reader fails, `parse_error` reads the file again with the standard
`json` module to find the first line that is not JSON and names the file and that line
(1-based, as an editor counts), so the user can open the file there.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import PipelineError

#: suffixes read as JSON (a JSON array, or one JSON object per line)
SUFFIXES = (".json", ".jsonl")


def is_array(path: Path) -> bool:
    """A .json file is either a JSON array (Alpaca style) or JSON lines; .jsonl is lines."""
    if Path(path).suffix.lower() == ".jsonl":
        return False
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read(1024).lstrip()[:1] == "["


def read_frame(path: Path):
    """The file's rows as a pandas DataFrame (pandas' own parsing, so columns and dtypes are
    what they always were); a broken line is one PipelineError naming it."""
    import pandas as pd

    try:
        return pd.read_json(path, lines=not is_array(path))
    except ValueError as exc:
        raise parse_error(path, exc) from None


def first_bad_line(path: Path) -> tuple[int, str] | None:
    """(1-based line, why) of the first line that is not JSON, or None when every line is.
    A JSON array is parsed whole and its error's line is named."""
    if is_array(path):
        data = Path(path).read_bytes()
        try:
            json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            return data[:exc.start].count(b"\n") + 1, "not UTF-8"
        except json.JSONDecodeError as exc:
            return exc.lineno, _why(exc)
        return None
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                json.loads(raw.rstrip(b"\r\n"))
            except ValueError as exc:
                return number, _why(exc)
    return None


def parse_error(path: Path, exc: BaseException) -> PipelineError:
    """What a reader's failure on `path` means, in one line: the broken line when there is
    one, else the reader's own first line."""
    found = first_bad_line(path)
    if found is None:
        return PipelineError(f"data file {path}: cannot parse ({str(exc).splitlines()[0]})")
    return line_error(path, *found)


def line_error(path: Path, line: int, why: str) -> PipelineError:
    return PipelineError(f"data file {path} line {line}: not valid JSON ({why}); fix or "
                         "remove that line")


def _why(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8"
    return str(exc).splitlines()[0]
