"""Source files in the forms users have them: each read as a stream of (where, row, reason).

    jsonl       one JSON object per line (optionally .gz); where = {"line": n}, 1-based
    json_array  one JSON array of objects, pretty-printed or not, as ShareGPT is distributed
                (`ShareGPT_V3_unfiltered_cleaned_split.json`; optionally .gz); where =
                {"record": i, "line": n}: 0-based index in the array, 1-based line it starts on
    parquet     a parquet file; where = {"row": i}, 0-based
    arrow       one Arrow IPC file or stream (a `data-*.arrow` of a datasets directory)
    arrow_dir   a Hugging Face `datasets` directory written by `save_to_disk` (state.json,
                dataset_info.json, data-*.arrow in the IPC stream format); rows counted over
                its files in state.json's order, as `dataset[i]` counts them

The form is told from the file itself (`sniff`), not from the configured format (which names the
rows' shape, draftsmith.data.rows). `records(path, form, status)` yields (where, row, None) for a
row decoded to a Python object and (where, None, reason) for one that is not (not UTF-8, not
JSON); `status` receives what the report says of the file as a whole: the table columns read,
and `truncated` (where the file is cut: a last record or line that the file ends inside, or a
JSON array without its closing bracket). A JSON array is decoded record by record over 1 MiB
chunks, so a 600 MB file never sits in memory whole. Parquet and Arrow are read with pyarrow
(imported only for them), in record batches, only the columns a row shape reads.
"""

from __future__ import annotations

import codecs
import gzip
import json
import re
from pathlib import Path

from draftsmith.data.rows import SourceError

CHUNK = 1 << 20
TABLE_BATCH = 1024
# table columns a row shape reads; a table needs one of the first three
TABLE_COLUMNS = ("conversations", "messages", "prompt", "system", "id")
WHITESPACE = re.compile(r"[ \t\r\n]*")
# a JSON decode error this close to the end of the text read so far may only need more text
NEAR_END = 16


def open_bytes(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def sniff(path: Path) -> str:
    """The form of `path` (see the module doc); SourceError for a directory of another kind."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits") or []
            raise SourceError(
                f"{path} is a datasets DatasetDict (splits {', '.join(splits)}): give one "
                f"split's directory, e.g. {path / (splits[0] if splits else 'train')}"
            )
        if (path / "state.json").is_file() or any(path.glob("data-*.arrow")):
            return "arrow_dir"
        raise SourceError(
            f"{path} is a directory but not a datasets save_to_disk directory (no state.json, "
            f"no data-*.arrow); give a file, or the directory `Dataset.save_to_disk` wrote"
        )
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic[:4] == b"PAR1":
        return "parquet"
    if magic[:6] == b"ARROW1" or magic[:4] == b"\xff\xff\xff\xff":
        return "arrow"
    with open_bytes(path) as f:
        head = f.read(4096)
    head = head.removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n")
    return "json_array" if head[:1] == b"[" else "jsonl"


def arrow_dir_files(path: Path) -> list[Path]:
    """The data files of a save_to_disk directory, in state.json's order."""
    state = path / "state.json"
    names = []
    if state.is_file():
        names = [d["filename"] for d in json.loads(state.read_text()).get("_data_files") or []]
    files = [path / n for n in names] or sorted(path.glob("data-*.arrow"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise SourceError(f"{path}: data files missing: {missing or 'no data-*.arrow'}")
    return files


def input_files(path: str) -> list[str]:
    """The files a source at `path` reads (a datasets directory's metadata and data files), for
    the workflow's inputs: editing any of them makes the rows stale."""
    p = Path(path)
    if not (p.is_dir() and (p / "state.json").is_file()):
        return [path]
    meta = [p / n for n in ("state.json", "dataset_info.json") if (p / n).is_file()]
    try:
        data = arrow_dir_files(p)
    except SourceError:
        data = []
    return [str(f) for f in meta + data]


def records(path: Path, form: str, status: dict):
    """Every row of `path` as (where, object or None, reason or None), in file order."""
    if form == "jsonl":
        return jsonl_records(path, status)
    if form == "json_array":
        return JsonArray(path, status).records()
    return table_records(path, form, status)


# ---------------------------------------------------------------- JSON Lines


def jsonl_records(path: Path, status: dict):
    """Lines as bytes: each line is decoded on its own, so a bad one names its line number."""
    with open_bytes(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = {"line": lineno}
            try:
                obj = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                yield where, None, jsonl_reason(e, raw, where, status)
                continue
            yield where, obj, None


def jsonl_reason(e: ValueError, raw: bytes, where: dict, status: dict) -> str:
    """Why a line is not read; a last line without its newline is the file's cut."""
    if isinstance(e, json.JSONDecodeError):
        reason = f"not JSON ({e.msg})"
    else:
        reason = (
            f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the line); "
            f"re-encode the file as UTF-8"
        )
    if raw.endswith(b"\n"):
        return reason
    status["truncated"] = {**where, "reason": "the file ends inside this line"}
    return f"truncated: the file ends inside this line ({reason})"


# ---------------------------------------------------------------- one JSON array, streamed


class JsonArray:
    """An incremental reader of one JSON array: `json.JSONDecoder.raw_decode` over a text buffer
    refilled a chunk at a time; the consumed text is dropped at every refill."""

    def __init__(self, path: Path, status: dict):
        self.path, self.status = path, status
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.line, self.eof = "", 0, 1, False
        self.file = None

    def fill(self) -> bool:
        """Append one more chunk of text; False at the end of the file."""
        if self.eof:
            return False
        raw = self.file.read(CHUNK)
        self.eof = not raw
        try:
            text = self.utf8.decode(raw, final=self.eof)
        except UnicodeDecodeError as e:
            if not self.eof:
                raise SourceError(
                    f"{self.path}: not UTF-8 (byte 0x{raw[e.start]:02x}) after line "
                    f"{self.line}; re-encode the file as UTF-8"
                ) from None
            text = ""  # the file ends inside a character: the record it cuts is named so
        self.buf, self.pos = self.buf[self.pos :] + text, 0
        return not self.eof or bool(text)

    def advance(self, to: int) -> None:
        self.line += self.buf.count("\n", self.pos, to)
        self.pos = to

    def peek(self) -> str | None:
        """The next character that is not whitespace (not consumed), None at the end."""
        while True:
            self.advance(WHITESPACE.match(self.buf, self.pos).end())
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return None

    def decode(self, index: int):
        """The record at the current position; (None, reason) when the file ends inside it."""
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                more = e.msg.startswith("Unterminated string") or e.pos >= len(self.buf) - NEAR_END
                if more and self.fill():
                    continue
                if more:
                    return None, f"truncated: the file ends inside this record ({e.msg})"
                raise SourceError(
                    f"{self.path}: record {index} (line {self.line}) of the JSON array is not "
                    f"JSON: {e.msg} at line {self.line + self.buf.count(chr(10), self.pos, e.pos)}"
                    f"; the records after it cannot be found, so the file is refused whole"
                ) from None
            if end >= len(self.buf) and self.fill():
                continue  # a number may go on in the next chunk
            self.advance(end)
            return obj, None

    def records(self):
        with open_bytes(self.path) as self.file:
            self.fill()
            self.buf = self.buf.removeprefix("\ufeff")
            if self.peek() != "[":
                raise SourceError(f"{self.path}: not a JSON array (no '[' at its start)")
            self.advance(self.pos + 1)
            index, after = 0, self.peek()
            while after not in ("]", None):
                where = {"record": index, "line": self.line}
                obj, reason = self.decode(index)
                yield where, obj, reason
                if reason:
                    self.status["truncated"] = {**where, "reason": "the file ends inside it"}
                    return
                index, after = index + 1, self.peek()
                if after == ",":
                    self.advance(self.pos + 1)
                    after = self.peek()
                elif after not in ("]", None):
                    raise SourceError(
                        f"{self.path}: expected ',' or ']' after record {index - 1} of the JSON "
                        f"array, found {after!r} at line {self.line}"
                    )
            self.end(index, after)

    def end(self, index: int, after: str | None) -> None:
        if after is None:
            self.status["truncated"] = {
                "record": index,
                "line": self.line,
                "reason": f"the file ends after record {index - 1} without the array's ']'",
            }
            return
        self.advance(self.pos + 1)
        if self.peek() is not None:
            raise SourceError(
                f"{self.path}: text after the JSON array's closing ']' at line {self.line}; "
                f"give one JSON array, or JSON Lines (one object per line)"
            )


# ---------------------------------------------------------------- parquet and Arrow tables


def pyarrow_modules(path: Path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(
            f"{path} is a parquet or Arrow file: reading it needs pyarrow (pinned in "
            f"envs/cpu.txt: pip install -r envs/cpu.txt) in the interpreter that reads sources"
        ) from None
    return pa, pq


def table_batches(path: Path, form: str):
    """(the schema's column names, an iterator of record batches) of a table file or directory."""
    pa, pq = pyarrow_modules(path)
    if form == "parquet":
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        cols = [c for c in TABLE_COLUMNS if c in names]
        return names, pf.iter_batches(batch_size=TABLE_BATCH, columns=cols)
    files = arrow_dir_files(path) if form == "arrow_dir" else [path]
    readers = [arrow_reader(pa, f) for f in files]
    names = readers[0].schema.names
    cols = [c for c in TABLE_COLUMNS if c in names]

    def batches():
        for f, reader in zip(files, readers, strict=True):
            if reader.schema.names != names:
                raise SourceError(f"{f}: its columns differ from {files[0]}'s")
            for batch in iter_batches(reader):
                yield batch.select(cols)

    return names, batches()


def arrow_reader(pa, path: Path):
    """An Arrow IPC stream (what datasets writes) or file (magic ARROW1) reader."""
    with open(path, "rb") as f:
        magic = f.read(6)
    source = pa.memory_map(str(path), "r")
    return pa.ipc.open_file(source) if magic == b"ARROW1" else pa.ipc.open_stream(source)


def iter_batches(reader):
    if hasattr(reader, "num_record_batches"):  # the IPC file format
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return reader


def table_records(path: Path, form: str, status: dict):
    pa, _ = pyarrow_modules(path)
    try:
        names, batches = table_batches(path, form)
        wanted = [c for c in TABLE_COLUMNS[:3] if c in names]
        if not wanted:
            raise SourceError(
                f"{path}: a {form} table with columns {names}: none of the columns a row shape "
                f"reads ({', '.join(TABLE_COLUMNS[:3])})"
            )
        status["columns"] = [c for c in TABLE_COLUMNS if c in names]
        row = 0
        for batch in batches:
            for obj in batch.to_pylist():
                yield {"row": row}, obj, None
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: not a readable {form} file ({type(e).__name__}: {e})") from None
