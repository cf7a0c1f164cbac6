"""flowsieve's Python streaming data source over one spool folder.

An offset names the files of its batch (``{"batch": N, "files": [...], "prev": [...]}``), not a
sequence number: several probes number their files independently, and a durable source publishes
a file later than files numbered after it, so files do not appear in sequence order. A batch
takes every file present except the previous batch's (Spark commits a batch's files only after
it has planned the next one); ``commit`` deletes the batch's files and the previous batch's (a
crash may have come between Spark's commit log and ours). ``partitions`` is deterministic for a
logged (start, end) because files stay until ``commit`` releases them, so a restarted query
re-plans its last batch exactly (FACTS, Spark). Holds only picklable state: options parsed into
typed fields.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

from collector.pipeline.spool import file_seq, list_files, schema_for, spark_ddl

START = {"batch": -1, "files": [], "prev": []}

FILES_PER_PARTITION = 16
QUARANTINE = "bad"


def _batches(path: str) -> list[pa.RecordBatch]:
    """Every batch of a spool file (all opened first: a corrupt file yields nothing). The
    batches map the file; the mapping lives as long as they do."""
    reader = pa.ipc.open_file(pa.memory_map(path))
    return [reader.get_batch(i) for i in range(reader.num_record_batches)]


def quarantine(path: str, error: Exception) -> None:
    """Move an unreadable spool file into ``bad/`` beside it (counted by the daemon's
    ``flowsieve_spool_quarantined_files``) so that it never stops the query."""
    bad = Path(path).parent / QUARANTINE
    bad.mkdir(exist_ok=True)
    try:
        os.replace(path, bad / Path(path).name)
        (bad / (Path(path).name + ".reason")).write_text(f"{type(error).__name__}: {error}\n")
    except FileNotFoundError:
        pass


class SpoolPartition(InputPartition):
    def __init__(self, paths: list[str]):
        super().__init__(paths)
        self.paths = paths


class SpoolDataSource(DataSource):
    """``spark.readStream.format("flowsieve_spool").option("path", …).option("stream", …)
    .option("folder", …)``."""

    @classmethod
    def name(cls) -> str:
        return "flowsieve_spool"

    def __init__(self, options):
        super().__init__(options)
        try:
            self.path = options["path"]
            self.stream = options["stream"]
            self.spool_folder = options["folder"]
        except KeyError as e:
            raise ValueError(f"flowsieve_spool needs the option {e.args[0]!r}") from None

    def schema(self) -> str:
        return spark_ddl(schema_for(self.stream, self.spool_folder))

    def streamReader(self, schema) -> DataSourceStreamReader:
        return SpoolStreamReader(self.path, self.stream, self.spool_folder)


class SpoolStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, path: str, stream: str, folder: str):
        self.path = path
        self.stream = stream
        self.folder = folder
        self.target: set[str] | None = None

    def _new(self, start: dict) -> list[str]:
        """Files present that no batch up to ``start`` took (an offset of an older version,
        ``{"seq": N}``, took every file numbered up to N)."""
        done = set(start.get("files", ()))
        files = list_files(Path(self.path))
        if "seq" in start:
            files = [f for f in files if file_seq(f) > start["seq"]]
        return [f.name for f in files if f.name not in done]

    def initialOffset(self) -> dict:
        return dict(START)

    def latestOffset(self, start: dict, limit) -> dict:
        new = self._new(start)
        if self.target is not None:
            new = [n for n in new if n in self.target]
        if not new:
            return start
        return {"batch": start.get("batch", -1) + 1, "files": new,
                "prev": list(start.get("files", ()))}

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = {f.name for f in list_files(Path(self.path))}

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        if end == start:
            return []
        paths = [os.path.join(self.path, n) for n in end["files"]]
        return [SpoolPartition(paths[i:i + FILES_PER_PARTITION])
                for i in range(0, len(paths), FILES_PER_PARTITION)]

    def read(self, partition: SpoolPartition):
        schema = schema_for(self.stream, self.folder)
        for path in partition.paths:
            try:
                batches = _batches(path)
            except FileNotFoundError:
                continue  # quarantined by an earlier attempt of this batch
            except (pa.ArrowInvalid, OSError) as e:
                quarantine(path, e)
                continue
            for batch in batches:
                if batch.schema != schema:
                    batch = pa.Table.from_batches([batch]).cast(schema).to_batches()[0]
                yield batch

    def commit(self, end: dict) -> None:
        if "seq" in end:  # an older version's offset
            names = [f.name for f in list_files(Path(self.path)) if file_seq(f) <= end["seq"]]
        else:
            names = [*end["prev"], *end["files"]]
        for n in names:
            try:
                os.remove(os.path.join(self.path, n))
            except FileNotFoundError:
                pass
