"""Apache Beam pipeline for :func:`torchgrain.convert` (``pip install 'torchgrain[beam]'``).

The same conversion as :func:`~torchgrain.convert`, with Beam distributing the output
shards over its workers: one output shard per input shard, or ``num_shards`` contiguous
slices of the global record order. Each shard is one element of the pipeline; the
worker writes it under a temporary name, reads it back to verify its count and
checksum, renames it, and records it, so a retried bundle or a rerun of the whole
pipeline skips shards already finished. The last step writes the manifest.

Planning happens where the pipeline is built: Parquet and ArrayRecord inputs are
counted from their footers; TFRecord inputs are counted only for ``num_shards`` (a
header walk per file, in threads).

``dst`` must be a directory every worker can write to: a local directory with the
DirectRunner, a shared or network filesystem (NFS, a FUSE-mounted bucket) on a
cluster. The source may be any fsspec URL the workers can read.

Example (DirectRunner)::

    import torchgrain as tg
    from torchgrain.beam import run_conversion

    tg.write_array_record(({"i": i} for i in range(10)), "/tmp/src", num_shards=2)
    manifest = run_conversion("/tmp/src", "/tmp/dst", num_shards=3)
    assert manifest.num_records == 10

From the command line, with any runner::

    python -m torchgrain.beam SRC DST --num-shards 64 -- --runner=FlinkRunner ...
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from torchgrain.convert import DEFAULT_OUTPUT
from torchgrain.convert.inputs import open_input
from torchgrain.convert.journal import Journal, finish, finished, manifest_path, plan_tasks
from torchgrain.convert.tasks import Job, Task, run_task
from torchgrain.formats.manifest import Manifest
from torchgrain.io.fs import get_filesystem, is_local
from torchgrain.sources.registry import get_output, output_formats

__all__ = ["ConvertShard", "build_pipeline", "run_conversion"]


def _import_beam() -> Any:
    try:
        import apache_beam as beam
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "torchgrain.beam needs Apache Beam: pip install 'torchgrain[beam]'"
        ) from e
    return beam


class ConvertShard:
    """Beam ``DoFn``-like callable: converts one planned output shard (idempotent).

    A shard already finished (its file and its journal entry present) is not redone,
    so Beam's retries and reruns of the pipeline are cheap and give the same result.
    """

    def __init__(self, job: Job) -> None:
        self.job = job

    def __call__(self, task: Task) -> dict[str, Any]:
        journal = Journal(self.job.root)
        done = journal.done().get(task.index)
        if done is not None and finished(self.job.root, task, done):
            return done
        result = run_task(self.job, task)
        journal.make()
        journal.record(result)
        return result


def _write_manifest(results: list[dict[str, Any]], job: Job, plan: dict[str, Any]) -> str:
    results = sorted(results, key=lambda r: r["index"])
    assert job.output is not None
    m = finish(job.root, job.input, job.output, plan["group_size"], job.compression, plan, results)
    return m.to_json()


def build_pipeline(
    pipeline: Any,
    src: str | os.PathLike | Sequence[str | os.PathLike],
    dst: str | os.PathLike,
    *,
    to: str = DEFAULT_OUTPUT,
    num_shards: int | None = None,
    group_size: int = 1,
    codec: Any = "auto",
    compression: str | None = None,
    src_format: str = "auto",
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Add the conversion to ``pipeline``; returns the PCollection holding the manifest JSON.

    Arguments as in :func:`torchgrain.convert` (one output shard per input shard unless
    ``num_shards`` is given).
    """
    beam = _import_beam()
    output = get_output(to)
    fs, root = get_filesystem(dst)
    if not is_local(fs):
        raise NotImplementedError(f"dst must be a directory all workers can write: {dst!r}")
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    compression, options = output.options(group_size, compression)
    inp = open_input(src, src_format, codec, storage_options)
    counts = inp.counts
    tasks = plan_tasks(counts, len(inp.paths), num_shards, to)
    job = Job(inp, root, to, options, compression, 32 << 20, verify, output=output)
    plan = {"counts": counts, "tasks": [asdict(t) for t in tasks], "group_size": group_size}
    return (
        pipeline
        | "PlanShards" >> beam.Create(tasks)
        | "Distribute" >> beam.Reshuffle()
        | "ConvertShard" >> beam.Map(ConvertShard(job))
        | "Collect" >> beam.combiners.ToList()
        | "WriteManifest" >> beam.Map(_write_manifest, job, plan)
    )


def run_conversion(
    src: str | os.PathLike | Sequence[str | os.PathLike],
    dst: str | os.PathLike,
    *,
    pipeline_options: Any = None,
    **kwargs: Any,
) -> Manifest:
    """Build and run the conversion pipeline (DirectRunner unless options say otherwise).

    Returns the manifest read back from ``dst`` (ArrayRecord output) or the one kept in
    ``dst/.torchgrain-convert/result.json`` (Parquet output).
    """
    beam = _import_beam()
    from apache_beam.options.pipeline_options import PipelineOptions

    options = pipeline_options or PipelineOptions([])
    with beam.Pipeline(options=options) as p:
        build_pipeline(p, src, dst, **kwargs)
    root = os.path.abspath(get_filesystem(dst)[1])
    path = manifest_path(root, get_output(kwargs.get("to", DEFAULT_OUTPUT)))
    with open(path) as f:
        return Manifest.from_json(f.read(), where=path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torchgrain.beam SRC DST [options] [-- beam pipeline options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, beam_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m torchgrain.beam")
    p.add_argument("src", nargs="+")
    p.add_argument("dst")
    p.add_argument("--to", choices=output_formats(), default=DEFAULT_OUTPUT)
    p.add_argument("--num-shards", type=int, default=None)
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--codec", default="auto")
    p.add_argument("--compression", default=None)
    args = vars(p.parse_args(argv))  # the rest: run_conversion's keyword arguments
    src, dst = args.pop("src"), args.pop("dst")
    from apache_beam.options.pipeline_options import PipelineOptions

    options = PipelineOptions(beam_args)
    m = run_conversion(src if len(src) > 1 else src[0], dst, pipeline_options=options, **args)
    print(f"wrote {m.num_records:,} records in {len(m.shards)} shard(s) to {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
