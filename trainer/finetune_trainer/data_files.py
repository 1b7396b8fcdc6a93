"""The files of a local dataset, and the error that names what is wrong with data.

Apart from `finetune_trainer.data` because listing the files needs neither the datasets
library nor torch: the resume check (`fingerprints`, before any worker starts) lists them too.
"""

from __future__ import annotations

from pathlib import Path

from finetune_trainer.uris import data_file_builder


class DataError(ValueError):
    """Training data that cannot be used: `where` (a file, line or column), what, and the fix."""

    def __init__(self, where: str, what: str, fix: str):
        super().__init__(f"{where}: {what} — {fix}")
        self.where, self.what, self.fix = where, what, fix


def local_data_files(uri: str, base_dir: Path | None = None) -> list[Path]:
    """The data files a local location names (a file, or every data file in a folder but
    hidden ones, as Hugging Face datasets skips them: `.ipynb_checkpoints/`, `.cache/`)."""
    path = local_path(uri, base_dir)
    if not path.exists():
        raise DataError(str(path), "does not exist",
                        "check spec.dataset.uri (relative paths start at the manifest's folder)")
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if data_file_builder(p.name) and p.is_file()
        and not any(part.startswith((".", "__")) for part in p.relative_to(path).parts))
    if not files:
        raise DataError(str(path), "holds no .jsonl, .json, .parquet or .csv file",
                        "point spec.dataset.uri at a data file or a folder of them")
    kinds = {data_file_builder(p.name) for p in files}
    if None in kinds:
        raise DataError(str(files[0]), f"has an unsupported extension {files[0].suffix!r}",
                        "use .jsonl, .json, .parquet or .csv")
    if len(kinds) > 1:
        raise DataError(str(path), f"mixes file types ({', '.join(sorted(kinds))})",
                        "keep one kind of data file per dataset")
    return files


def local_path(uri: str, base_dir: Path | None) -> Path:
    """Where a local `dataset.uri` is: absolute, or relative to `base_dir` (the manifest's
    folder; the working directory where none is given)."""
    path = Path(uri)
    return path if path.is_absolute() else (base_dir or Path.cwd()) / path
