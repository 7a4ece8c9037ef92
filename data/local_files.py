"""Local data files: which of a folder's .json / .jsonl / .parquet files make up a split (by their names, as the hub's
loader reads them), and reading them into rows, with a paragraph naming the file when one cannot be read.
"""

import contextlib
import json
import pathlib
import re

from config.errors import UserError

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


# A folder's training split never reads a file named after a held-out split, or one in a folder so named: names
# starting with test, eval or valid, and dev or val as a whole word (`dev.jsonl`, `val-00000.parquet`, not
# `devices.jsonl`), the hub's datasets library's names for test and validation files.
HELD_OUT_NAME = re.compile(r"test|eval|valid|(dev|val)(?![a-zA-Z])")


# The hub's shard names (`data/train_sft-00000-of-00003.parquet`, older pushes with a fingerprint after them) name their
# split whole, as does the folder of its Parquet conversion's numbered files (`default/train_sft/0000.parquet`):
# `train` is not `train_sft`, as the hub's own loader reads them.
HUB_SHARD = re.compile(r"(.+)-\d{5}-of-\d{5}(?:-[0-9a-f]+)?")


def hub_split(file: pathlib.Path, folder: pathlib.Path) -> str | None:
    """The split a file of `folder` is in by the hub's layouts, whole (`HUB_SHARD`); None for a file named otherwise."""
    if shard := HUB_SHARD.fullmatch(file.stem):
        return shard.group(1)
    parts = file.relative_to(folder).parts
    return parts[-2] if len(parts) > 1 and file.stem.isdigit() else None


def split_names(file: pathlib.Path, folder: pathlib.Path) -> list[str]:
    """The names that say which split a file of `folder` is in: the folders between them, and its own name less the
    suffix (`train/part-0.jsonl`: train and part-0; the hub's `data/train-00000-of-00001.parquet`: data and train-...)."""
    relative = file.relative_to(folder)
    return [*relative.parts[:-1], relative.stem]


def load_local(path: pathlib.Path, split: str, held_out: bool) -> list[dict]:
    """Load a local data file, or the files in a folder (hidden ones, such as `.ipynb_checkpoints/`, left out): those
    named after `split`, or in a folder so named; for the training split, when none is, every file not named after a
    held-out split (`HELD_OUT_NAME`), nor in a folder so named. A folder without files of a held-out split has no
    such split: a UserError, as is a folder `datasets`' save_to_disk wrote (Arrow files beside .json metadata)."""
    if not path.is_dir():
        return read_files(path, [path])
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file() and any(path.glob("*.arrow")):
        raise UserError(f"data.path {str(path)!r} is a folder written by `datasets`' save_to_disk: its Arrow files are "
                        "not read here, and its .json files are metadata, not rows. Write the rows as Parquet "
                        "(`datasets.load_from_disk(folder).to_parquet('train.parquet')`; a DatasetDict's each split "
                        "to its own `<split>.parquet` in one folder) and set data.path to that file or folder.")
    return read_files(path, split_files(path, folder_files(path), split, held_out))


def folder_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The data files under a folder, hidden ones (and those in hidden folders) left out; a folder named like a data
    file (Spark's `train.parquet/` of part files) is no file, its parts are. Symlinked folders are walked (a split's
    `train/` linked from elsewhere), each real folder once and none that holds `path` itself (a link back up)."""
    root, files, seen = path.resolve(), [], set()
    for folder, folders, names in path.walk(follow_symlinks=True):
        real = folder.resolve()
        if real in seen or (real != root and root.is_relative_to(real)):
            folders.clear()
            continue
        seen.add(real)
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        files += [folder / name for name in names if pathlib.Path(name).suffix in LOCAL_FORMATS and not name.startswith(".")]
    return sorted(files)


def hidden_in(file: pathlib.Path, folder: pathlib.Path) -> bool:
    """Whether `file` lies in `folder` under a hidden name (`.ipynb_checkpoints/`, `.runs/`), which no split reads."""
    return any(part.startswith(".") for part in file.relative_to(folder).parts)


def split_files(path: pathlib.Path, files: list[pathlib.Path], split: str, held_out: bool) -> list[pathlib.Path]:
    """Which of a folder's data `files` one split reads (`load_local`)."""
    # A folder holding train.jsonl and test.jsonl, or train/ and test/ folders, must not mix the two splits, a
    # folder of training files alone must not pass them off as held-out ones, nor one of held-out files alone as
    # training ones.
    hub = {file: hub_split(file, path) for file in files}
    named = [file for file in files if hub[file] == split
             or hub[file] is None and any(name.startswith(split) for name in split_names(file, path))]
    shard_splits = sorted({name for name in hub.values() if name is not None})
    if files and not named and shard_splits:  # no other split read in its place (train_sft and train_gen for `train`)
        key = "data.eval_split" if held_out else "data.train_split"
        raise UserError(f"data.path {str(path)!r} has no {split} split: its files are laid out as the hub's, in the splits "
                        f"{', '.join(shard_splits)}. Set {key} to one of them (HuggingFaceH4/ultrachat_200k: "
                        "--data.train_split train_sft --data.eval_split test_sft)"
                        + (", or set data.eval_path to a file of held-out rows." if held_out else "."))
    if files and not named and held_out:
        others = {str(file.relative_to(path)): match.group(0) for file in files for name in split_names(file, path)
                  if (match := HELD_OUT_NAME.match(name))}
        hint = "".join(f"; {other} is named after a held-out split: data.eval_split={name} evaluates on it"
                       for other, name in list(others.items())[:1])
        raise UserError(f"data.path {str(path)!r} has no {split} split: none of its files, nor a folder they are in, "
                        f"is named {split}*{hint}. Or set data.eval_path to a file of held-out rows.")
    training = [file for file in files if not any(HELD_OUT_NAME.match(name) for name in split_names(file, path))]
    if files and not named and not training:  # they would be trained on, and evaluated on as the held-out split
        raise UserError(f"data.path {str(path)!r} has no {split} split: its files are all named after held-out splits "
                        f"({', '.join(str(file.relative_to(path)) for file in files[:3])}). Name the training rows' file "
                        f"{split}.jsonl (or put them in a {split}/ folder), or set data.path to the file itself (a "
                        "single file's rows are all training rows).")
    return named or training


def reads_any(folder: pathlib.Path, written: list[pathlib.Path], splits: list[tuple[str, bool]]) -> bool:
    """Whether any of the files a run would write under `folder` (`written`) becomes a row of one of its `splits`
    ((split, held out)) as the folder's loader picks files, with the folder's files as they are now."""
    written = [file for file in written if not hidden_in(file, folder)]
    files = sorted({*folder_files(folder), *written})
    for split, held_out in splits:
        try:
            read = split_files(folder, files, split, held_out)
        except UserError:  # no such held-out split: nothing read
            continue
        if any(file in read for file in written):
            return True
    return False


def read_files(path: pathlib.Path, files: list[pathlib.Path]) -> list[dict]:
    """The rows of local data files of one format (`path`: the file or folder data.path names, for the errors)."""
    formats = {LOCAL_FORMATS.get(file.suffix) for file in files}
    if not files or len(formats) != 1 or None in formats:
        raise UserError(f"data.path {str(path)!r} must be a .json, .jsonl or .parquet file, or a folder holding "
                        f"files of one of those formats; found {[file.name for file in files]}.")
    broken = [str(file.relative_to(path)) for file in files if not file.exists()]
    if broken:
        raise UserError(f"data.path {str(path)!r}: {broken[0]} is a symlink to nothing ({file_target(path / broken[0])}). "
                        "Fix the link, or remove it.")
    empty = [file.name for file in files if file.stat().st_size < 4096 and not file.read_bytes().strip()]
    if empty:
        raise UserError(f"data.path {str(path)!r}: {', '.join(empty)} is empty. Fix the file, or set data.path to another one.")
    try:
        return json_rows(path, files) if formats == {"json"} else parquet_rows(files)
    except UnicodeDecodeError as error:
        raise UserError(f"data.path {str(path)!r} is not UTF-8 text ({undecodable_line(files) or error}). Re-encode "
                        "it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or set data.path to another file.") from None
    except Exception as error:
        reason = (formats == {"parquet"} and first_bad_file(files)) or innermost_reason(error)
        raise UserError(f"data.path {str(path)!r} could not be read as a table ({reason}). Fix the file, or set "
                        "data.path to another one.") from None


def file_target(link: pathlib.Path) -> str:
    """Where a symlink points, as it is written."""
    return str(link.readlink()) if link.is_symlink() else "missing"


def undecodable_line(files: list[pathlib.Path]) -> str | None:
    """The first line of the files that is not UTF-8, with the file's name, its number and why; None when none is."""
    for file in files:
        for number, line in enumerate(file.read_bytes().split(b"\n"), 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"{file.name}, line {number}: {error}"
    return None


def parquet_rows(files: list[pathlib.Path]) -> list[dict]:
    """The rows of Parquet files, read as one table by pyarrow (the reader under `datasets`), with no cache between runs:
    `datasets.load_dataset` keeps a local file's table in its cache under the file's path and modification time, so a
    file rewritten in place with its time kept (`touch -r`, `cp -p`, `rsync -t`) was read as its old rows, and every
    cache keyed on the rows (`data.cache`) followed them. Files of differing columns, or of no rows, are refused."""
    import pyarrow
    import pyarrow.parquet

    tables = [pyarrow.parquet.read_table(file) for file in files]
    if len({tuple(sorted(table.column_names)) for table in tables}) > 1 or not all(table.num_rows for table in tables):
        raise BadRows(first_bad_file(files))  # differing columns, or a file of no rows
    return pyarrow.concat_tables(tables, promote_options="default").to_pylist()  # columns in any order, one table


def json_rows(path: pathlib.Path, files: list[pathlib.Path]) -> list[dict]:
    """The rows of .json / .jsonl files as Python's JSON reader gives them, each row with every column of the files
    (None where it has none, as a table gives them); BadRows when one is not rows of objects or their columns
    differ. Not `datasets`' reader: a column of mixed types it keeps as JSON text and reads back as JSON, so a row's
    text "2", "null" or "true" came back as 2, None or True once another row gave a number there. `path`: the file
    or folder data.path names; a folder's files are told apart by their path in it."""
    tables = {str(file.relative_to(path)) if path.is_dir() else file.name: json_file_rows(file) for file in files}
    columns = {name: list(dict.fromkeys(key for row in rows for key in row)) for name, rows in tables.items()}
    reason = differing_columns({name: sorted(names) for name, names in columns.items()})
    if reason:
        raise BadRows(reason)
    names = list(dict.fromkeys(name for file_columns in columns.values() for name in file_columns))
    rows = [row for file_rows in tables.values() for row in file_rows]
    for row in rows:  # in place: a copy of every row would double the rows' memory while it is made
        for name in names:
            row.setdefault(name, None)
    return rows


class BadRows(ValueError):
    """Why a data file is not rows of JSON objects, naming the file (and the line or element)."""


class RepeatedKey(ValueError):
    """A JSON object that gives a key twice (Python's reader would keep the last one given)."""


def unique_object(pairs: list[tuple]) -> dict:
    """A JSON object's pairs as a dict; RepeatedKey when one key comes twice."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise RepeatedKey(f"gives the key {key!r} twice")
        seen.add(key)
    return dict(pairs)


def json_kind(value) -> str:
    """The JSON name of a value's kind, as the errors give it (`null`, else the Python type: int, list, str)."""
    return "null" if value is None else type(value).__name__


def json_file_rows(file: pathlib.Path) -> list[dict]:
    """A .json or .jsonl file's rows; BadRows for a line or an array's element that is not a JSON object, a key given
    twice, or no rows at all. A .json file is one JSON document (an array of objects, or one object) or JSON lines,
    as is a .jsonl file that opens with `[` (as the hub's loader reads both); a blank line is no row; an empty object
    is a row (of no columns, dropped and counted where it is read)."""
    rows, lines = None, None
    with open(file, encoding="utf-8-sig") as start:
        array = start.read(4096).lstrip().startswith("[")
    if file.suffix == ".json" or array:
        text = file.read_text(encoding="utf-8-sig")
        try:
            whole = json.loads(text, object_pairs_hook=unique_object)
        except RepeatedKey as error:
            raise BadRows(f"{file.name} {error}") from None
        except ValueError as error:
            if array:
                raise BadRows(f"{file.name} is not JSON: {error}") from None
            lines = text.split("\n")  # JSON lines in a .json file; not splitlines, as JSON text may hold U+2028
        else:
            rows = whole if isinstance(whole, list) else [whole]
            other = next(((number, row) for number, row in enumerate(rows, 1) if not isinstance(row, dict)), None)
            if other and isinstance(whole, list):
                raise BadRows(f"{file.name}, element {other[0]}, is a JSON {json_kind(other[1])}, not an object")
            if other:
                raise BadRows(f"{file.name} is a JSON {json_kind(whole)}, not an object or a list of objects")
    if rows is None:
        rows = []
        with contextlib.nullcontext(lines) if lines is not None else open(file, encoding="utf-8-sig") as numbered:
            for number, line in enumerate(numbered, 1):
                if line.strip():
                    rows.append(json_line_row(file, number, line))
    if not any(rows):
        raise BadRows(f"{file.name} holds no rows")
    return rows


def json_line_row(file: pathlib.Path, number: int, line: str) -> dict:
    """Line `number` of a JSON lines `file` as a row; BadRows, naming the line, when it is not a JSON object."""
    try:
        row = json.loads(line, object_pairs_hook=unique_object)
    except RepeatedKey as error:
        raise BadRows(f"{file.name}, line {number}, {error}") from None
    except ValueError as error:
        raise BadRows(f"{file.name}, line {number}, is not JSON: {error}") from None
    if not isinstance(row, dict):
        raise BadRows(f"{file.name}, line {number}, is a JSON {json_kind(row)}, not an object")
    return row


def first_bad_file(files: list[pathlib.Path]) -> str | None:
    """Which of the Parquet files the table reader failed on, and why, or None when none shows a fault: a file that
    is damaged or holds no rows, or files whose columns differ (a folder's files are read as one table). Read only
    after a failure, so a large set pays nothing for it."""
    import pyarrow.parquet

    columns = {}
    for file in files:
        try:
            metadata = pyarrow.parquet.read_metadata(file)
        except Exception as error:  # noqa: BLE001 - pyarrow's reasons are several classes; each is the user's file
            return f"{file.name} is not a readable Parquet file: {innermost_reason(error)}"
        if metadata.num_rows == 0:
            return f"{file.name} holds no rows"
        columns[file.name] = sorted(metadata.schema.to_arrow_schema().names)
    return differing_columns(columns)


def differing_columns(columns: dict[str, list[str]]) -> str | None:
    """Why files of these (sorted) `columns` by name cannot be one table, or None when all have the same."""
    differing = [(name, names) for name, names in columns.items() if names != next(iter(columns.values()))]
    if not differing:
        return None
    (first, first_names), (other, other_names) = next(iter(columns.items())), differing[0]
    return (f"its files' columns differ: {first} has {first_names}, {other} has {other_names}; a folder's files "
            "are read as one table, so give them the same columns or point data.path at one kind")


def innermost_reason(error: BaseException) -> str:
    """The message of the exception at the bottom of `error`'s chain (datasets wraps pyarrow's, which says why)."""
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__
    return " ".join(str(error).split()) or type(error).__name__
