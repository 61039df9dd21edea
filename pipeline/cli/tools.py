"""`pipeline tools ...`: read-only commands over the store (dump, tombstones, verify).

Every StorageError (a file that is not a segment, a directory or file that cannot be read)
is one line on stderr and exit status 1, never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable

import click

from pipeline.broker.storage.inspect import dump_segment, tombstone_rows, verify
from pipeline.wire.errors import StorageError


def _one_line_errors(command: Callable) -> Callable:
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except StorageError as exc:
            raise click.ClickException(str(exc)) from exc
    return wrapper


@click.group("tools")
def tools() -> None:
    """Inspect and verify the disk tier's segment files (read-only)."""


@tools.command("dump-segment")
@click.argument("path", type=click.Path(dir_okay=False, readable=False))
@click.option("--entries", "max_entries", type=click.IntRange(min=0), default=None,
              help="List at most this many entries.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def dump_segment_command(path: str, max_entries: int | None, as_json: bool) -> None:
    """Header and entries of one segment: state, lengths, checksum status, damage."""
    dump = dump_segment(path, max_entries)
    if as_json:
        click.echo(json.dumps(dump, indent=2))
        return
    for key, value in dump["header"].items():
        click.echo(f"{key:>14}: {value:#x}" if key == "signature" else f"{key:>14}: {value}")
    scanned = dump["scanned"]
    click.echo(f"{'scanned':>14}: {scanned['entries']} whole entries ({scanned['live']} live, "
               f"{scanned['tombstones']} tombstones), whole entries end at {scanned['data_end']}, "
               f"counts agree: {scanned['counts_agree']}")
    for problem in scanned["problems"]:
        click.echo(f"{'DAMAGE':>14}: {problem}")
    for torn in scanned["torn"]:
        click.echo(f"{'torn tail':>14}: {torn['end'] - torn['offset']} bytes at offset {torn['offset']} "
                   f"(an unacknowledged write; kept)")
    click.echo(f"{'offset':>10} {'state':<9} {'length':>7} {'item_id':>20} {'producer':>8} {'seq':>10} {'checksum':>8}")
    for e in dump["entries"]:
        click.echo(f"{e['offset']:>10} {e['state']:<9} {e['length']:>7} {e['item_id']:>20} "
                   f"{e['producer_id']:>8} {e['seq']:>10} {e['checksum']:>8}")


@tools.command("dump-tombstones")
@click.argument("data_dir", type=click.Path(file_okay=False, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def dump_tombstones_command(data_dir: str, as_json: bool) -> None:
    """Per segment: live and tombstoned entries, the deleted count, and whether they agree."""
    rows = tombstone_rows(data_dir)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'live':>8} {'tombs':>8} {'deleted':>8} {'agree':>5}  segment")
    for row in rows:
        if "error" in row:
            click.echo(f"{'':>8} {'':>8} {'':>8} {'ERROR':>5}  {row['error']}")
        else:
            click.echo(f"{row['live']:>8} {row['tombstones']:>8} {row['deleted_count']:>8} "
                       f"{'yes' if row['agree'] else 'NO':>5}  {row['path']}{'  DAMAGED' if row['damaged'] else ''}")


@tools.command("verify")
@click.argument("data_dir", type=click.Path(file_okay=False, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def verify_command(data_dir: str, as_json: bool) -> None:
    """Exit 0 only when nothing is damaged, lost, missing (per the catalog), quarantined or
    stray, checksums hold and counts agree. Torn tails of unacknowledged writes are listed
    as notes: they lose nothing."""
    result = verify(data_dir)
    if as_json:
        click.echo(json.dumps({
            "ok": result.ok, "segments": result.segments, "entries": result.entries,
            "live": result.live, "tombstones": result.tombstones,
            "bytes_scanned": result.bytes_scanned, "quarantined_files": result.quarantined_files,
            "counts": dict(result.counts), "problems": result.problems, "notes": result.notes,
        }, indent=2))
    else:
        click.echo(f"{result.segments} segments, {result.entries} entries "
                   f"({result.live} live, {result.tombstones} tombstones), {result.bytes_scanned} bytes; "
                   f"{result.quarantined_files} files in quarantine")
        for note in result.notes:
            click.echo(f"note: {note}")
        for problem in result.problems:
            click.echo(f"PROBLEM: {problem}")
        click.echo("OK" if result.ok else f"FAILED: {len(result.problems)} problems")
    sys.exit(0 if result.ok else 1)
