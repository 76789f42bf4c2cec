"""Errors raised by the data pipeline. Each names the record (or file) and the problem."""

from __future__ import annotations


class DataError(ValueError):
    """A data source or flag that cannot be used as given."""


class BadRecordError(DataError):
    """One source record that cannot become a sample. ``problem`` is a short machine-friendly key."""

    def __init__(self, record_id: str, problem: str, detail: str, source: str = "") -> None:
        self.record_id = record_id
        self.problem = problem
        self.detail = detail
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(
            f"bad record {record_id!r}{where}: {problem}: {detail} "
            "(pass --on-bad-record skip to skip such records and count them in the dataset card)"
        )


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key or file."""
